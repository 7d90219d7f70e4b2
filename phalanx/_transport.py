"""The one HTTP transport to a Phalanx server: base URL, bearer token, timeouts, error answers,
and the retry policy of `phalanx._retry` applied to them.

Three senders use it: the SDK (`phalanx.client.Client`, hence the CLI and the agent), and a
training rank's metric sender and checkpoint committer (`phalanx.train._http`). It is written on
httpx and tenacity and never imports pydantic: a rank loads it only when an agent launched it, and
loaded httpx and tenacity there already before the transport was shared, so a training script's
import cost and its loop (`report()` is a queue put) are unchanged.

Contract:
- `Transport.request` returns a response below 400; raises `Conflict` for a 409 (the object moved
  on: a superseded allocation, a state change that lost a race), `ApiError` for any other error
  answer (with the server's message), and lets `httpx.TransportError` through (no answer).
- `is_transient(exc)` is the one answer to "may a retry succeed?".
- `reliably(fn)` retries `fn` on transient errors with `backoff_delay`, never sooner than the
  server's `Retry-After` asked (`ApiError.retry_after`), blocking the caller. The
  metric sender cannot block (its thread must keep draining the training loop's queue), so it
  schedules its own retries with the same `is_transient` and `backoff_delay`.
- A `Transport` may be shared by threads (httpx.Client is thread-safe for requests).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay

from phalanx._retry import is_retryable_status, retry_after_s, retry_delay

API_PREFIX = "/api/v1"
DEFAULT_TIMEOUT_S = 30.0
# Long enough to outlast a server restart or a database failover; a caller that cannot wait that
# long passes its own.
DEFAULT_GIVE_UP_AFTER_S = 3600.0

logger = logging.getLogger("phalanx.transport")
T = TypeVar("T")


class ApiError(Exception):
    """The server answered with an error status; `message` is its explanation for a person."""

    def __init__(self, status: int, message: str, detail: Any = None, retry_after: float | None = None) -> None:
        super().__init__(f"{message} (HTTP {status})")
        self.status, self.message, self.detail = status, message, detail
        self.retry_after = retry_after  # seconds the server asked to wait before a retry


class Conflict(ApiError):
    """409: what the request acted on has moved on. For a running allocation this means a newer
    attempt superseded it: its metrics and checkpoints are refused for good."""


def error_from(response: httpx.Response) -> ApiError:
    """The exception for an error answer (read in full), with the server's `{"error", "detail"}`."""
    try:
        body = response.json()
    except ValueError:  # not JSON: a proxy's page, or nothing
        body = None
    if isinstance(body, dict):
        message, detail = body.get("error", response.text), body.get("detail")
    else:
        message, detail = response.text or response.reason_phrase, None
    kind = Conflict if response.status_code == 409 else ApiError
    return kind(response.status_code, str(message), detail, retry_after_s(response.headers.get("retry-after")))


def is_transient(exc: BaseException) -> bool:
    """True when a retry may succeed: no answer at all, or a status `phalanx._retry` retries."""
    if isinstance(exc, ApiError):
        return is_retryable_status(exc.status)
    return isinstance(exc, httpx.TransportError)


def _wait(state: RetryCallState) -> float:
    exc = state.outcome.exception() if state.outcome else None
    return retry_delay(state.attempt_number, exc.retry_after if isinstance(exc, ApiError) else None)


def reliably(fn: Callable[[], T], *, give_up_after: float = DEFAULT_GIVE_UP_AFTER_S, log: logging.Logger = logger) -> T:
    """Call `fn` until it succeeds, fails for a reason retrying cannot fix (that exception is
    raised), or `give_up_after` seconds have passed (the last exception is raised)."""

    def warn(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning("server unreachable or busy (%s); retrying", exc)

    retrying = Retrying(
        retry=retry_if_exception(is_transient),
        wait=_wait,
        stop=stop_after_delay(give_up_after),
        before_sleep=warn,
        reraise=True,
    )
    return retrying(fn)


class Transport:
    """One connection pool to one server, with its token. Paths are relative to `/api/v1`."""

    def __init__(self, url: str, token: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.token = token or ""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def set_token(self, token: str) -> None:
        """Send `token` on every later request (requests in flight keep the one they were built with)."""
        self.token = token
        self._http.headers["Authorization"] = f"Bearer {token}"

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request (httpx's keyword arguments: params, json, content, files, headers, timeout)."""
        response = self._http.request(method, API_PREFIX + path, **kwargs)
        if response.status_code >= 400:
            raise error_from(response)
        return response

    @contextlib.contextmanager
    def stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """Like `request`, with the body left unread for `iter_bytes()`."""
        with self._http.stream(method, API_PREFIX + path, **kwargs) as response:
            if response.status_code >= 400:
                response.read()
                raise error_from(response)
            yield response

    def healthy(self, timeout: float = 2.0) -> bool:
        """Whether the server answers its health check (never raises)."""
        try:
            return self._http.get("/healthz", timeout=timeout).status_code == 200
        except httpx.TransportError:
            return False

    def close(self) -> None:
        self._http.close()
