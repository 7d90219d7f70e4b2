"""The shared HTTP transport and its retry policy, against a real HTTP server on 127.0.0.1: the
SDK (`Client`), a rank's metric sink and its checkpoint committer all answer the same way."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from phalanx._retry import (
    INITIAL_BACKOFF_S,
    MAX_BACKOFF_S,
    MAX_RETRY_AFTER_S,
    RETRYABLE_STATUSES,
    backoff_delay,
    is_retryable_status,
    retry_after_s,
    retry_delay,
)
from phalanx._transport import ApiError, Conflict, Transport, is_transient, reliably
from phalanx.client import Client
from phalanx.train._http import HttpMetricSink, http_committer
from phalanx.train._metrics import SendOutcome

Answer = tuple[int, bytes]  # status, body


class ScriptedServer:
    """Answers each request with the next scripted (status, body), then with `default`."""

    def __init__(self, answers: list[Answer] | None = None, default: Answer = (200, b"{}")) -> None:
        self.answers = list(answers or [])
        self.default = default
        self.headers: dict[str, str] = {}  # sent with every answer
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with outer._lock:
                    status, payload = outer.answers.pop(0) if outer.answers else outer.default
                    outer.requests.append(
                        {
                            "method": self.command,
                            "path": self.path,
                            "auth": self.headers.get("Authorization"),
                            "body": body,
                        }
                    )
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for name, value in outer.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    yield scripted
    scripted.close()


def error(message: str, detail: Any = None) -> bytes:
    return json.dumps({"error": message, "detail": detail}).encode()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


# --- the policy ------------------------------------------------------------------------------


def test_which_statuses_are_retried() -> None:
    assert {408, 425, 429} == RETRYABLE_STATUSES
    for status in range(400, 600):
        expected = status >= 500 or status in (408, 425, 429)
        assert is_retryable_status(status) is expected, status
        assert is_transient(ApiError(status, "x")) is expected, status


def test_no_answer_is_transient_and_other_exceptions_are_not() -> None:
    assert is_transient(httpx.ConnectError("refused"))
    assert is_transient(httpx.ReadTimeout("slow"))
    assert not is_transient(Conflict(409, "superseded"))
    assert not is_transient(ValueError("a bug"))


@pytest.mark.parametrize("failures", [1, 2, 3, 5, 8, 100, 10**6])
def test_backoff_doubles_is_jittered_and_capped(failures: int) -> None:
    delays = [backoff_delay(failures) for _ in range(200)]
    full = min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * 2 ** min(failures - 1, 40))
    assert all(full / 2 <= d <= full for d in delays)
    assert len(set(delays)) > 100  # jittered, so that peers that failed together spread out
    assert all(d <= 30.0 for d in (backoff_delay(failures, maximum=30.0) for _ in range(50)))


# --- the transport ---------------------------------------------------------------------------


def test_errors_carry_the_server_s_message_and_409_is_a_conflict(server: ScriptedServer) -> None:
    server.answers = [
        (409, error("allocation 7 was superseded by attempt 3")),
        (422, error("resources.nodes: must be at least 1", [{"loc": ["nodes"]}])),
        (502, b"<html>bad gateway</html>"),
    ]
    transport = Transport(server.url, "tok")
    try:
        with pytest.raises(Conflict) as conflict:
            transport.request("POST", "/allocations/7/metrics", json={})
        assert conflict.value.status == 409 and conflict.value.message == "allocation 7 was superseded by attempt 3"
        with pytest.raises(ApiError) as refused:
            transport.request("GET", "/jobs")
        assert not isinstance(refused.value, Conflict)
        assert (refused.value.status, refused.value.detail) == (422, [{"loc": ["nodes"]}])
        assert "resources.nodes" in str(refused.value) and "HTTP 422" in str(refused.value)
        with pytest.raises(ApiError) as proxy:
            transport.request("GET", "/jobs")
        assert proxy.value.status == 502 and "bad gateway" in proxy.value.message
        assert transport.request("GET", "/jobs").status_code == 200
    finally:
        transport.close()
    assert [r["path"] for r in server.requests] == ["/api/v1/allocations/7/metrics", *["/api/v1/jobs"] * 3]
    assert {r["auth"] for r in server.requests} == {"Bearer tok"}


def test_no_token_sends_no_authorization_and_health_never_raises(server: ScriptedServer) -> None:
    with Client(server.url, "") as client:
        assert client.healthy()
    assert server.requests[0]["path"] == "/healthz" and server.requests[0]["auth"] is None
    with Client(closed_port_url(), "") as client:
        assert not client.healthy()
        with pytest.raises(httpx.TransportError):
            client.list_jobs()


def test_the_sdk_raises_conflict_as_an_api_error(server: ScriptedServer) -> None:
    server.answers = [(409, error("job 3 is COMPLETED; it cannot be killed"))]
    with Client(server.url, "tok") as client, pytest.raises(ApiError) as raised:
        client.kill_job(3)
    assert isinstance(raised.value, Conflict) and raised.value.status == 409


def test_reliably_retries_what_may_succeed_and_nothing_else(server: ScriptedServer) -> None:
    transport = Transport(server.url)
    try:
        server.answers = [(503, error("restarting")), (429, error("slow down")), (200, b"{}")]
        assert reliably(lambda: transport.request("POST", "/x"), give_up_after=30).status_code == 200
        assert len(server.requests) == 3

        server.answers = [(400, error("bad request"))]
        with pytest.raises(ApiError) as refused:
            reliably(lambda: transport.request("POST", "/x"), give_up_after=30)
        assert refused.value.status == 400 and len(server.requests) == 4  # not retried
    finally:
        transport.close()


def test_reliably_gives_up_with_the_last_error() -> None:
    transport = Transport(closed_port_url())
    start = time.monotonic()
    with pytest.raises(httpx.TransportError):
        reliably(lambda: transport.request("GET", "/jobs"), give_up_after=0.5)
    assert time.monotonic() - start < 10
    transport.close()


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("1", 1.0),
        (" 3 ", 3.0),
        ("600", MAX_RETRY_AFTER_S),
        ("9" * 10, MAX_RETRY_AFTER_S),
        ("9" * 11, None),
        (None, None),
        ("", None),
        ("-1", None),
        ("1.5", None),
        ("1e9", None),
        ("Wed, 21 Oct 2026 07:28:00 GMT", None),
        ("\u0661", None),  # a digit, but not an ASCII one
    ],
)
def test_retry_after_is_read_in_seconds_and_bounded(header: str | None, seconds: float | None) -> None:
    assert retry_after_s(header) == seconds


@pytest.mark.parametrize("failures", [1, 2, 3, 10])
def test_a_retry_never_comes_sooner_than_the_server_asked(failures: int) -> None:
    assert retry_delay(failures, 2.0) >= 2.0
    assert retry_delay(failures, 0.0) <= MAX_BACKOFF_S
    assert retry_delay(failures, None) <= min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * 2 ** (failures - 1))


def test_reliably_waits_as_long_as_the_server_asks(server: ScriptedServer) -> None:
    server.headers = {"Retry-After": "1"}
    server.answers = [(429, error("busy"))]
    transport = Transport(server.url)
    try:
        start = time.monotonic()
        assert reliably(lambda: transport.request("POST", "/x"), give_up_after=30).status_code == 200
        assert time.monotonic() - start >= 1.0, "came back before the Retry-After"
        assert len(server.requests) == 2
    finally:
        transport.close()


# --- a rank's two senders --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        ((200, b"{}"), SendOutcome.DELIVERED),
        ((409, error("superseded")), SendOutcome.SUPERSEDED),
        ((503, error("restarting")), SendOutcome.RETRY),
        ((429, error("slow down")), SendOutcome.RETRY),
        ((400, error("bad records")), SendOutcome.REJECTED),
        ((401, error("bad token")), SendOutcome.REJECTED),
    ],
)
def test_metric_sink_outcomes(server: ScriptedServer, answer: Answer, outcome: SendOutcome) -> None:
    server.answers = [answer]
    sink = HttpMetricSink(server.url, 7, "tok")
    records = [{"rank": 0, "step": 1, "time": 1.0, "values": {"loss": 0.5}}]
    assert sink.send(records, timeout=5, batch_id="b-0") is outcome  # type: ignore[arg-type]
    sink.close()
    (request,) = server.requests
    assert request["path"] == "/api/v1/allocations/7/metrics" and request["auth"] == "Bearer tok"
    assert json.loads(request["body"]) == {"records": records, "batch_id": "b-0"}


def test_metric_sink_keeps_the_wait_the_server_asked_for(server: ScriptedServer) -> None:
    server.headers = {"Retry-After": "2"}
    server.answers = [(429, error("busy")), (503, b"")]
    sink = HttpMetricSink(server.url, 7, "tok")
    try:
        assert sink.send([], timeout=5, batch_id="b-0") is SendOutcome.RETRY and sink.retry_after == 2.0
        server.headers = {}
        assert sink.send([], timeout=5, batch_id="b-0") is SendOutcome.RETRY and sink.retry_after is None
    finally:
        sink.close()


def test_metric_sink_retries_when_the_server_is_down() -> None:
    sink = HttpMetricSink(closed_port_url(), 7, None)
    assert sink.send([], timeout=2, batch_id="b-0") is SendOutcome.RETRY
    sink.close()


def test_checkpoint_commit_retries_then_records_and_a_conflict_is_false(server: ScriptedServer) -> None:
    body = {"step": 3, "path": "file:///ckpt/step-3", "size_bytes": 10, "metrics": {}}
    server.answers = [(503, error("restarting")), (200, b"{}"), (409, error("superseded")), (400, error("bad path"))]
    commit = http_committer(server.url, 5, "tok")
    assert commit(body) is True
    assert [r["path"] for r in server.requests] == ["/api/v1/allocations/5/checkpoints"] * 2
    assert commit(body) is False
    with pytest.raises(ApiError):
        commit(body)
    assert len(server.requests) == 4
    assert json.loads(server.requests[0]["body"]) == body
