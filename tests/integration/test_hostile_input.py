"""Hostile input gets a clear 4xx and changes nothing: ids no row can have, out-of-range counts,
metric batches and agent reports the database could not store; a batch sent twice is stored once."""

from __future__ import annotations

import io
import json
import logging
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from scheduler.service import schedule_pass
from server.checkpoints import delete_marked
from server.db import session_scope
from server.models import Allocation, Checkpoint, Job, LogLine, Metric
from server.settings import Settings
from tests.agent_tokens import as_agent, as_rank, token_of
from tests.conftest import AGENT_TOKEN
from tests.integration.test_api import AGENT, USER, count, spec

PAST_INT32 = 2**31
PAST_INT64 = 2**63


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("GET", f"/api/v1/jobs/{PAST_INT32}", USER),
        ("GET", f"/api/v1/jobs/{PAST_INT32}/logs", USER),
        ("POST", f"/api/v1/jobs/{PAST_INT32}/kill", USER),
        ("GET", f"/api/v1/jobs/1/checkpoints/{PAST_INT64}/archive", USER),
        ("GET", f"/api/v1/studies/{PAST_INT32}", USER),
        ("POST", f"/api/v1/agents/{PAST_INT32}/heartbeat", AGENT),
        ("GET", f"/api/v1/agents/{PAST_INT32}/work", AGENT),
        ("GET", "/api/v1/jobs/0", USER),
        ("GET", "/api/v1/jobs/-1", USER),
        ("GET", "/api/v1/jobs/seven", USER),
    ],
)
def test_an_id_no_row_can_have_answers_404(client: TestClient, method: str, path: str, headers: dict[str, str]) -> None:
    answer = client.request(method, path, headers=headers)
    assert answer.status_code == 404, answer.text
    assert "no such row can exist" in answer.json()["error"]


def test_a_page_with_such_an_id_answers_404_too(client: TestClient) -> None:
    from tests.integration.test_dashboard import sign_in

    sign_in(client)
    answer = client.get(f"/jobs/{PAST_INT32}")
    assert answer.status_code == 404 and "text/html" in answer.headers["content-type"]


@pytest.mark.parametrize(
    "url",
    [
        f"/api/v1/jobs?offset={PAST_INT32}",
        "/api/v1/jobs?limit=0",
        "/api/v1/jobs?limit=1001",
        "/api/v1/studies?limit=1001",
        f"/api/v1/studies?offset={PAST_INT32}",
        "/api/v1/agents?limit=1001",
        "/api/v1/jobs/1/logs?limit=10001",
        "/api/v1/jobs/1/metrics?limit=100001",
        "/api/v1/jobs/1/metrics?name=" + "n" * 129,
        "/api/v1/jobs/1?state=QUEUED&wait=301",
        "/api/v1/studies/1?version=v&wait=301",
    ],
)
def test_out_of_range_counts_answer_422(client: TestClient, url: str) -> None:
    answer = client.get(url, headers=USER)
    assert answer.status_code == 422 and answer.json()["error"].startswith("invalid request: query."), answer.text


def test_a_huge_rank_or_cursor_answers_422_not_500(client: TestClient) -> None:
    job_id = client.post(
        "/api/v1/jobs",
        files={"spec": (None, '{"name": "j", "entrypoint": "python t.py"}', "application/json")},
        headers=USER,
    ).json()["id"]
    for query in (f"rank={PAST_INT32}", f"after={PAST_INT64}"):
        answer = client.get(f"/api/v1/jobs/{job_id}/logs?{query}", headers=USER)
        assert answer.status_code == 422, (query, answer.text)


@pytest.fixture
def allocation_id(client: TestClient, settings: Settings) -> int:
    """A placed one-node job's allocation."""
    submitted = client.post(
        "/api/v1/jobs",
        files={"spec": (None, '{"name": "j", "entrypoint": "python t.py"}', "application/json")},
        headers=USER,
    )
    with session_scope(settings.database_url) as session:
        schedule_pass(session)
    detail = client.get(f"/api/v1/jobs/{submitted.json()['id']}", headers=USER).json()
    return int(detail["allocations"][-1]["id"])


def record(**overrides: Any) -> dict[str, Any]:
    return {"rank": 0, "step": 1, "time": 1.0, "values": {"loss": 0.5}, **overrides}


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        # NaN and the infinities are values ("NaN", "Infinity", "-Infinity"); no other string is
        (json.dumps({"records": [record(values={"loss": "nan"})]}), '"NaN", "Infinity", "-Infinity"'),
        (json.dumps({"records": [record(values={"loss": "1.5"})]}), "a metric value is a number"),
        (json.dumps({"records": [record(values={"loss": True})]}), "a metric value is a number"),
        (json.dumps({"records": [record(values={"loss": None})]}), "a metric value is a number"),
        ('{"records": [{"rank": 0, "step": 1, "time": 1.0, "values": {"loss": 1' + "0" * 400 + "}}]}", "too large"),
        ('{"records": [{"rank": 0, "step": 1, "time": NaN, "values": {"loss": 1.0}}]}', "finite"),
        (json.dumps({"records": [record(values={"x" * 200: 1.0})]}), "at most 128 characters"),
        (json.dumps({"records": [record(step=2**63)]}), "less than or equal"),
        (json.dumps({"records": [record(rank=2**31)]}), "less than or equal"),
        (json.dumps({"records": [record(time=1e300)]}), "less than or equal"),
        (json.dumps({"records": [record(values={"": 1.0})]}), "at least 1 character"),
    ],
)
def test_a_bad_metric_batch_answers_422_and_stores_nothing(
    client: TestClient, settings: Settings, allocation_id: int, raw: str, problem: str
) -> None:
    answer = client.post(
        f"/api/v1/allocations/{allocation_id}/metrics",
        content=raw,
        headers={**as_rank(client, allocation_id), "Content-Type": "application/json"},
    )
    assert answer.status_code == 422 and problem in answer.json()["error"], answer.text
    with session_scope(settings.database_url) as session:
        assert session.scalar(select(func.count()).select_from(Metric)) == 0


def test_checkpoint_metrics_and_node_reports_are_bounded(client: TestClient, allocation_id: int) -> None:
    commit = {"step": 1, "path": "file:///x/job-1/step-1", "size_bytes": 1, "metrics": {"loss": "inf"}}
    answer = client.post(
        f"/api/v1/allocations/{allocation_id}/checkpoints", json=commit, headers=as_rank(client, allocation_id)
    )
    assert answer.status_code == 422, answer.text
    exit_body = {"node_rank": 0, "exit_code": 2**40, "reason": ""}
    answer = client.post(f"/api/v1/agents/1/allocations/{allocation_id}/exit", json=exit_body, headers=as_agent(1))
    assert answer.status_code == 422, answer.text


@pytest.mark.parametrize("storage", ["file:///etc", "http://example.com/ckpt", "memory://x", "ftp://host/x"])
def test_checkpoint_storage_outside_the_allowed_roots_is_refused_at_submit(
    client: TestClient, settings: Settings, storage: str
) -> None:
    spec = {"name": "j", "entrypoint": "python t.py", "checkpoint": {"storage": storage}}
    answer = client.post("/api/v1/jobs", files={"spec": (None, json.dumps(spec))}, headers=USER)
    assert answer.status_code == 422 and "checkpoint.storage" in answer.json()["error"], answer.text
    with session_scope(settings.database_url) as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0


def test_a_sub_path_of_the_default_root_is_accepted(client: TestClient, settings: Settings) -> None:
    spec = {"name": "j", "entrypoint": "python t.py", "checkpoint": {"storage": f"{settings.checkpoint_uri}/team-a"}}
    assert client.post("/api/v1/jobs", files={"spec": (None, json.dumps(spec))}, headers=USER).status_code == 201


def job_root(client: TestClient, settings: Settings) -> Path:
    job_id = client.get("/api/v1/jobs", headers=USER).json()[0]["id"]
    return Path(settings.checkpoint_uri.removeprefix("file://")) / f"job-{job_id}"


def test_a_committed_path_that_climbs_out_of_the_job_is_refused(
    client: TestClient, settings: Settings, allocation_id: int
) -> None:
    root = job_root(client, settings)
    for path in (f"file://{root}/../../../etc", f"file://{root}/../job-999/step-1", f"file://{root}-evil/step-1"):
        body = {"step": 1, "path": path, "size_bytes": 1}
        answer = client.post(
            f"/api/v1/allocations/{allocation_id}/checkpoints", json=body, headers=as_rank(client, allocation_id)
        )
        assert answer.status_code == 422 and "outside this job's storage" in answer.json()["error"], path


def test_an_archive_never_follows_a_symlink_out_of_the_checkpoint(
    client: TestClient, settings: Settings, allocation_id: int, tmp_path: Path
) -> None:
    root = job_root(client, settings)
    folder = root / "step-1"
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(b"weights")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the job's owner")
    (folder / "leak").symlink_to(secret)
    body = {"step": 1, "path": f"file://{folder}", "size_bytes": 7}
    assert (
        client.post(
            f"/api/v1/allocations/{allocation_id}/checkpoints", json=body, headers=as_rank(client, allocation_id)
        ).status_code
        == 201
    )
    job_id = client.get("/api/v1/jobs", headers=USER).json()[0]["id"]
    archive = client.get(f"/api/v1/jobs/{job_id}/checkpoints/1/archive", headers=USER)
    assert archive.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(archive.content), mode="r:gz") as tar:
        assert tar.getnames() == ["state.pt"]


def test_retention_goes_on_past_a_row_it_cannot_delete(settings: Settings, allocation_id: int, tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    with session_scope(settings.database_url) as session:
        allocation = session.get(Allocation, allocation_id)
        assert allocation is not None
        for step, path in ((1, "no-such-protocol://x/y"), (2, f"file://{gone}")):
            session.add(
                Checkpoint(
                    job_id=allocation.job_id,
                    allocation_id=allocation_id,
                    attempt=1,
                    step=step,
                    metrics={},
                    size_bytes=1,
                    path=path,
                    state="DELETING",
                )
            )
    with session_scope(settings.database_url) as session:
        assert delete_marked(session, allocation.job_id) == 1  # the good row; the bad one stays, logged
    assert not gone.exists()
    with session_scope(settings.database_url) as session:
        assert session.scalars(select(Checkpoint.path)).all() == ["no-such-protocol://x/y"]


def test_every_page_forbids_inline_script_and_framing(client: TestClient) -> None:
    from tests.integration.test_dashboard import sign_in

    sign_in(client)
    job_id = client.post(
        "/api/v1/jobs",
        files={"spec": (None, '{"name": "j", "entrypoint": "python t.py"}', "application/json")},
        headers=USER,
    ).json()["id"]
    pages = ("/overview", "/jobs", f"/jobs/{job_id}", "/agents", "/studies", "/submit", "/docs", "/redoc")
    for path in (*pages, "/api/v1/jobs"):
        answer = client.get(path, headers=USER if path.startswith("/api/") else {})
        policy = answer.headers["content-security-policy"]
        assert "script-src 'self';" in policy and "frame-ancestors 'none'" in policy, path
        assert answer.headers["x-content-type-options"] == "nosniff" and answer.headers["x-frame-options"] == "DENY"
        assert "onsubmit=" not in answer.text and "onclick=" not in answer.text, path
        assert "<script>" not in answer.text and "cdn." not in answer.text, path


def test_the_sdk_drops_a_refused_batch_once_with_one_line_and_sends_the_next(
    client: TestClient, settings: Settings, allocation_id: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A 4xx answers the same on every try: the rank's sender logs it once, drops that batch, and
    the next batch goes through (a real server: the refusal is the server's own 422)."""
    from phalanx.train._http import HttpMetricSink
    from phalanx.train._metrics import MetricPipeline
    from tests.integration.test_dashboard_live import LiveServer

    with LiveServer(settings) as live:
        sink = HttpMetricSink(live.url, allocation_id, token_of(as_rank(client, allocation_id)))
        pipeline = MetricPipeline(rank=0, sink=sink, flush_interval_s=0.05)
        with caplog.at_level(logging.WARNING, logger="phalanx.train"):
            pipeline.queue.put((1, 1.0, {"x" * 200: 1.0}))  # a name past 128 characters: 422
            assert pipeline.flush(timeout=30)
            for step in (2, 3):
                pipeline.queue.put((step, 1.0, {"loss": 0.5}))
            assert pipeline.flush(timeout=30)
            pipeline.close(timeout=5)
    stats = pipeline.stats()
    assert (stats.rejected, stats.sent, stats.failed_attempts, stats.pending) == (1, 2, 0, 0)  # never retried
    refusals = [r.getMessage() for r in caplog.records if r.name == "phalanx.train"]
    assert len(refusals) == 1 and "refused 1 metric records" in refusals[0] and "128 characters" in refusals[0]
    with session_scope(settings.database_url) as session:
        assert sorted(session.scalars(select(Metric.step))) == [2, 3]


# --- a batch sent twice is stored once ------------------------------------------------------


def line_count(settings: Settings) -> int:
    with session_scope(settings.database_url) as session:
        return int(session.scalar(select(func.count()).select_from(LogLine)) or 0)


def metric_count(settings: Settings) -> int:
    with session_scope(settings.database_url) as session:
        return int(session.scalar(select(func.count()).select_from(Metric)) or 0)


def test_a_log_batch_sent_again_is_answered_204_and_stored_once(
    client: TestClient, settings: Settings, allocation_id: int
) -> None:
    url = f"/api/v1/agents/1/allocations/{allocation_id}/logs"
    lines = [{"rank": 0, "time": 1.0, "line": f"line {i}"} for i in range(3)]
    for _ in range(2):
        assert client.post(url, json={"lines": lines, "batch_id": "s-0"}, headers=as_agent(1)).status_code == 204
    assert line_count(settings) == 3
    # the next batch of the same stream, and the same lines under another id: both are new
    assert client.post(url, json={"lines": lines[:1], "batch_id": "s-3"}, headers=as_agent(1)).status_code == 204
    assert client.post(url, json={"lines": lines, "batch_id": "other-0"}, headers=as_agent(1)).status_code == 204
    assert line_count(settings) == 7
    # without an id, the same bytes are the same batch
    raw = json.dumps({"lines": [{"rank": 1, "time": 2.0, "line": "no id"}]})
    for _ in range(2):
        answer = client.post(url, content=raw, headers={**as_agent(1), "Content-Type": "application/json"})
        assert answer.status_code == 204
    assert line_count(settings) == 8
    too_long = client.post(url, json={"lines": lines, "batch_id": "x" * 65}, headers=as_agent(1))
    assert too_long.status_code == 422 and "batch_id" in too_long.json()["error"]


def test_a_metric_batch_sent_again_is_stored_once_with_or_without_an_id(
    client: TestClient, settings: Settings, allocation_id: int
) -> None:
    url = f"/api/v1/allocations/{allocation_id}/metrics"
    with_id = {"records": [record(step=s) for s in range(3)], "batch_id": "r-0"}
    without_id = json.dumps({"records": [record(step=s) for s in range(3, 5)]})
    for _ in range(2):
        assert client.post(url, json=with_id, headers=as_rank(client, allocation_id)).status_code == 204
        answer = client.post(
            url, content=without_id, headers={**as_rank(client, allocation_id), "Content-Type": "application/json"}
        )
        assert answer.status_code == 204
    assert metric_count(settings) == 5


def test_the_agent_retries_a_log_batch_whose_answer_was_lost_under_the_same_id(
    settings: Settings, allocation_id: int, tmp_path: Path
) -> None:
    from phalanx.client import Client
    from phalanx.schemas import LogLineIn
    from tests.integration.test_dashboard_live import LiveServer
    from worker_agent.agent import AgentConfig, AgentDaemon

    sent: list[str | None] = []

    class AnswerLostOnce(Client):
        """The real client; its first delivery reaches the server, and the answer never comes back."""

        def ship_log_batches(self, agent_id: int, batches: Any) -> Any:
            outcomes = super().ship_log_batches(agent_id, batches)
            sent.extend(batch.batch_id for batch in batches)
            if len(sent) == 1:
                raise httpx.ReadTimeout("the answer was lost")
            return outcomes

    with LiveServer(settings) as live:
        config = AgentConfig(live.url, AGENT_TOKEN, "a0", "127.0.0.1", 2, 0, tmp_path / "work")
        agent = AgentDaemon(config)
        agent.client = AnswerLostOnce(live.url, token_of(as_agent(1)))
        agent.agent_id = 1
        for i in range(3):
            agent.shipper.add(allocation_id, LogLineIn(rank=0, time=1.0, line=f"line {i}"))
        agent.shipper.flush(allocation_id)
        agent.shipper.add(allocation_id, LogLineIn(rank=0, time=2.0, line="line 3"))
        agent.shipper.flush(allocation_id)
        agent.client.close()
    assert len(sent) == 3 and sent[0] == sent[1] != sent[2]
    assert str(sent[0]).endswith("-0") and str(sent[2]).endswith("-3")
    assert line_count(settings) == 4


def test_metric_points_come_in_pages(client: TestClient, allocation_id: int) -> None:
    posted = client.post(
        f"/api/v1/allocations/{allocation_id}/metrics",
        json={"records": [record(step=s) for s in range(5)]},
        headers=as_rank(client, allocation_id),
    )
    assert posted.status_code == 204
    job_id = client.get("/api/v1/jobs", headers=USER).json()[0]["id"]
    url = f"/api/v1/jobs/{job_id}/metrics"
    first = client.get(url, params={"limit": 3}, headers=USER).json()
    rest = client.get(url, params={"limit": 3, "after": first[-1]["id"]}, headers=USER).json()
    assert [p["step"] for p in first] == [0, 1, 2] and [p["step"] for p in rest] == [3, 4]


# --- caps on requests held open ---------------------------------------------------------------


def wait_until(predicate: Any, what: str) -> None:
    """Until `predicate()` holds (another thread's request got as far as it), failing after 10 s."""
    from tests.processes import wait_for

    wait_for(predicate, 10, what, interval=0.01)


def test_a_user_past_the_cap_of_long_polls_gets_429_with_retry_after(client: TestClient, settings: Settings) -> None:
    holds = client.app.state.services.holds  # type: ignore[attr-defined]
    holds.per_holder = 1  # (PHALANX_MAX_HELD_REQUESTS_PER_HOLDER, read when the app was made)
    job_id = client.post(
        "/api/v1/jobs", files={"spec": (None, '{"name": "j", "entrypoint": "python t.py"}')}, headers=USER
    ).json()["id"]
    url = f"/api/v1/jobs/{job_id}"
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.get, url, params={"state": "QUEUED", "wait": 30}, headers=USER)
        wait_until(lambda: holds.held() == 1, "the first long-poll to be held")
        second = client.get(url, params={"state": "QUEUED", "wait": 30}, headers=USER)
        assert second.status_code == 429 and second.headers["retry-after"] == "5"
        assert "PHALANX_MAX_HELD_REQUESTS_PER_HOLDER" in second.json()["error"]
        assert client.get(url, headers=USER).status_code == 200  # a plain read holds nothing
        assert client.post(f"{url}/kill", headers=USER).status_code == 200
        assert first.result(timeout=30).json()["state"] == "CANCELLED"
    assert holds.held() == 0  # released: the next long-poll is taken
    assert client.get(url, params={"state": "QUEUED", "wait": 1}, headers=USER).status_code == 200


def test_the_servers_cap_counts_every_holder(client: TestClient, settings: Settings) -> None:
    holds = client.app.state.services.holds  # type: ignore[attr-defined]
    holds.total = 1
    version = client.get("/api/v1/agents/1/work", headers=as_agent(1)).json()["version"]
    with ThreadPoolExecutor(1) as pool:
        agent_poll = pool.submit(
            client.get, "/api/v1/agents/1/work", params={"version": version, "wait": 1}, headers=as_agent(1)
        )
        wait_until(lambda: holds.held("agent 1") == 1, "the agent's long-poll to be held")
        study = client.get("/api/v1/studies/1", params={"version": "v", "wait": 30}, headers=USER)
        assert study.status_code == 429 and "PHALANX_MAX_HELD_REQUESTS)" in study.json()["error"]
        assert agent_poll.result(timeout=30).status_code == 200
    assert holds.held() == 0


def test_a_user_past_the_cap_of_live_streams_gets_429_and_a_closed_one_frees_its_slot(
    client: TestClient, settings: Settings
) -> None:
    from tests.integration.test_dashboard_live import COOKIE, LiveServer

    settings.max_held_requests_per_holder = 1
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, cookies=COOKIE, timeout=30) as http:
        holds = live.server.config.app.state.services.holds
        with http.stream("GET", "/events/jobs") as stream:
            assert stream.status_code == 200
            refused = http.get("/events/jobs")
            assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
            assert "PHALANX_MAX_HELD_REQUESTS_PER_HOLDER" in refused.text
        wait_until(lambda: holds.held() == 0, "the closed stream to free its slot")
        with http.stream("GET", "/events/jobs") as stream:
            assert stream.status_code == 200


@pytest.mark.parametrize(
    ("bundle", "problem"),
    [
        ("zip_slip", "outside its folder"),
        ("absolute", "outside its folder"),
        ("symlink_out", "points outside it"),
        ("million_files", "more than 10000 files"),
    ],
)
def test_a_hostile_bundle_is_refused_at_upload_and_nothing_is_kept(
    client: TestClient, settings: Settings, bundle: str, problem: str
) -> None:
    from tests.unit.test_bundle_limits import entry, million_empty_files, tar_gz

    data = {
        "zip_slip": lambda: tar_gz((entry("../../../etc/cron.d/x"), b"* * * * * root sh\n")),
        "absolute": lambda: tar_gz((entry("/etc/passwd"), b"x")),
        "symlink_out": lambda: tar_gz((entry("./k", tarfile.SYMTYPE, "/root/.ssh/id_rsa"), None)),
        "million_files": million_empty_files,
    }[bundle]().getvalue()
    started = time.monotonic()
    files = {"spec": (None, json.dumps(spec(resources={"nodes": 1})), "application/json"), "bundle": ("b.tar.gz", data)}
    answer = client.post("/api/v1/jobs", files=files, headers=USER)
    assert answer.status_code == 422 and problem in answer.json()["error"], answer.text
    assert answer.json()["error"].startswith("bundle: ")
    assert time.monotonic() - started < 10
    assert count(settings, Job) == 0
    assert list(settings.bundle_dir.glob("*")) == []  # neither the bundle nor its partial copy


def test_a_client_that_hangs_up_mid_body_costs_no_traceback(
    client: TestClient, settings: Settings, allocation_id: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Under load, thousands of clients time out with their request half sent; each used to cost
    a logged traceback, and the server spent its core formatting them."""
    from server.models import AllocationNode

    with session_scope(settings.database_url) as session:
        agent_id = session.scalars(
            select(AllocationNode.agent_id).where(AllocationNode.allocation_id == allocation_id)
        ).one()
    headers = [(k.lower().encode(), v.encode()) for k, v in as_agent(agent_id).items()]
    path = f"/api/v1/agents/{agent_id}/allocations/{allocation_id}/logs"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [*headers, (b"content-type", b"application/json"), (b"content-length", b"1000")],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    arriving = [{"type": "http.request", "body": b'{"lines": [', "more_body": True}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return arriving.pop(0) if arriving else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with caplog.at_level(logging.INFO):
        client.portal.call(client.app, scope, receive, send)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert sent[0]["status"] == 400
    with session_scope(settings.database_url) as session:
        assert session.scalar(select(func.count()).select_from(LogLine)) == 0
