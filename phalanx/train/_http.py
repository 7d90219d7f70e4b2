"""A rank's senders to the Phalanx server, on the shared transport (`phalanx._transport`):
metric batches (`HttpMetricSink`, for the pipeline's thread; their answers may ask for a profile),
checkpoint commits (`http_committer`, for the checkpoint thread) and profile traces
(`http_profile_sender`, for the profiler's sending thread).

Imported only when the agent launched the process, so that a script run outside Phalanx loads no
HTTP stack. No pydantic here either: the bodies are dicts, shaped like the server's
`MetricBatchIn` and `CheckpointCommit`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from phalanx._transport import ApiError, Conflict, Transport, is_transient, reliably
from phalanx.train._metrics import SEND_TIMEOUT_S, MetricRecordDict, SendOutcome

logger = logging.getLogger("phalanx.train")

_JSON = {"Content-Type": "application/json"}
# A commit is retried this long through a server outage; past it the previous checkpoint stays latest.
COMMIT_GIVE_UP_AFTER_S = 600.0
COMMIT_TIMEOUT_S = 30.0
PROFILE_GIVE_UP_AFTER_S = 120.0


class HttpMetricSink:
    """One transport, used only by the metrics thread. Never raises and never waits to retry: it
    says what became of the batch, and the pipeline schedules any retry (`_retry.backoff_delay`)."""

    def __init__(
        self, url: str, allocation_id: int, token: str | None, on_profile: Callable[[int, int], None] | None = None
    ) -> None:
        self._transport = Transport(url, token, timeout=SEND_TIMEOUT_S)
        self._path = f"/allocations/{allocation_id}/metrics"
        self._on_profile = on_profile  # (profile id, steps): the server asks for a profile
        self.retry_after: float | None = None

    def send(self, records: list[MetricRecordDict], timeout: float, batch_id: str) -> SendOutcome:
        # orjson: a second's records encode in ~40 us instead of ~0.7 ms with json, and this
        # thread shares the GIL (and on small machines the core) with the training loop.
        body = orjson.dumps({"records": records, "batch_id": batch_id})
        try:
            response = self._transport.request("POST", self._path, content=body, headers=_JSON, timeout=timeout)
        except Conflict:
            return SendOutcome.SUPERSEDED
        except (ApiError, httpx.HTTPError) as exc:
            self.retry_after = exc.retry_after if isinstance(exc, ApiError) else None
            if is_transient(exc):
                logger.debug("phalanx: metrics request failed: %s", exc)
                return SendOutcome.RETRY
            # It will not change on a retry; keeping the batch would block every later one.
            logger.warning("phalanx: server refused %d metric records: %s", len(records), str(exc)[:500])
            return SendOutcome.REJECTED
        if response.status_code == 200 and self._on_profile is not None:
            self._read_answer(response.content)
        return SendOutcome.DELIVERED

    def _read_answer(self, content: bytes) -> None:
        """`MetricBatchAnswer`: a profile the server asks for, if any."""
        try:
            order = orjson.loads(content).get("profile")
            if order:
                self._on_profile(int(order["id"]), int(order["steps"]))  # type: ignore[misc]
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
            logger.debug("phalanx: unreadable answer to a metric batch: %s", exc)

    def close(self) -> None:
        self._transport.close()


def http_profile_sender(
    url: str, allocation_id: int, token: str | None, rank: int
) -> Callable[[int, bytes | None, str | None], None]:
    """PUT this rank's gzipped trace (or, with none, why) for a profile, retrying through outages;
    raises `ApiError` when the server refuses it (too large: 413, not a trace: 422)."""
    transport = Transport(url, token, timeout=COMMIT_TIMEOUT_S)

    def send(profile_id: int, trace: bytes | None, error: str | None) -> None:
        path = f"/allocations/{allocation_id}/profiles/{profile_id}/ranks/{rank}"
        if trace is not None:
            content, kind = trace, "application/gzip"
        else:
            content, kind = orjson.dumps({"message": (error or "no trace")[:4000]}), "application/json"
        reliably(
            lambda: transport.request("PUT", path, content=content, headers={"Content-Type": kind}),
            give_up_after=PROFILE_GIVE_UP_AFTER_S,
            log=logger,
        )

    return send


def http_committer(url: str, allocation_id: int, token: str | None) -> Callable[[dict[str, Any]], bool]:
    """POST the commit, retrying through outages; True when recorded, False when this allocation
    was superseded (409). Any other refusal raises `ApiError`."""
    transport = Transport(url, token, timeout=COMMIT_TIMEOUT_S)
    path = f"/allocations/{allocation_id}/checkpoints"

    def commit(body: dict[str, Any]) -> bool:
        try:
            reliably(
                lambda: transport.request("POST", path, json=body), give_up_after=COMMIT_GIVE_UP_AFTER_S, log=logger
            )
        except Conflict as exc:
            logger.error("phalanx: checkpoint refused, this attempt was superseded: %s", exc.message[:300])
            return False
        return True

    return commit
