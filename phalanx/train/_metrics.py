"""The metrics pipeline behind `Context.report()`.

The training thread only appends `(step, unix_time, values)` to a SimpleQueue. One daemon thread
turns those items into `MetricRecord`-shaped dicts (this is where 0-dim tensors are read, so a
CUDA sync never lands on the training loop) and hands them to a sink in batches. Without a sink
(the script runs outside Phalanx) the records are kept in memory.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice
from queue import Empty, SimpleQueue
from typing import Any, Protocol, TypedDict

from phalanx import _wire
from phalanx._retry import METRICS_MAX_BACKOFF_S, retry_delay

logger = logging.getLogger("phalanx.train")

MAX_BATCH = 5_000  # records per request: keeps one POST well under a megabyte
MAX_BUFFER = 100_000  # records held while the server is unreachable; the oldest go first
FLUSH_INTERVAL_S = 1.0  # batching window: one request per second instead of one per step (each costs server CPU)
SEND_TIMEOUT_S = 10.0
# The shared backoff, capped higher than for the agent's reports (`phalanx._retry`); flush() and
# close() retry at once regardless.
MAX_BACKOFF_S = METRICS_MAX_BACKOFF_S
URGENT_RETRY_S = 0.1  # while someone waits in flush()/close(), retry often instead of backing off


class MetricRecordDict(TypedDict):
    """The JSON form of phalanx.schemas.MetricRecord (kept as a dict: no pydantic on this path).
    On its way to a server a NaN or infinite value is already its wire string ("NaN", "Infinity",
    "-Infinity": `phalanx._wire`); records kept in memory hold plain floats."""

    rank: int
    step: int
    time: float
    values: dict[str, float | str]


class SendOutcome(enum.Enum):
    DELIVERED = "delivered"
    RETRY = "retry"  # the server was unreachable or overloaded: keep the records, try again later
    REJECTED = "rejected"  # the server refused this batch for good (bad token, bad request): drop it
    SUPERSEDED = "superseded"  # 409: a newer attempt owns the job; this process must wind down


class MetricSink(Protocol):
    # the wait the server asked for (`Retry-After`) with the last batch answered RETRY, if it asked
    retry_after: float | None

    def send(self, records: list[MetricRecordDict], timeout: float, batch_id: str) -> SendOutcome:
        """Deliver one batch. A retried batch has the same records and `batch_id`, so the server
        stores it once even when an earlier answer was lost."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class MetricStats:
    """Counters of what happened to reported records; `pending` is still on its way."""

    records: int  # records taken off the queue and converted
    sent: int
    pending: int
    dropped_overflow: int  # oldest records dropped because the buffer was full
    nonfinite: int  # nan/inf values reported (kept, and sent as "NaN", "Infinity", "-Infinity")
    dropped_invalid: int  # values that are not numbers, non-str keys, steps that are not integers
    rejected: int  # records in batches the server refused for good
    discarded_superseded: int  # records not sent because this allocation was superseded
    failed_attempts: int  # requests that will be retried
    lost_at_close: int  # records still pending when close() gave up


class _FlushMarker:
    """Put in the queue by flush(): released once everything queued before it is dealt with."""

    __slots__ = ("abandoned", "done")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.abandoned = False


QueueItem = tuple[Any, float, dict[Any, Any]] | _FlushMarker


class MetricPipeline:
    def __init__(
        self,
        rank: int,
        sink: MetricSink | None,
        *,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        max_batch: int = MAX_BATCH,
        max_buffer: int = MAX_BUFFER,
    ) -> None:
        self.queue: SimpleQueue[QueueItem] = SimpleQueue()
        self.superseded = False
        self._rank = rank
        self._sink = sink
        self._flush_interval_s = flush_interval_s
        self._max_batch = max_batch
        self._max_buffer = max_buffer

        self._buffer: deque[MetricRecordDict] = deque()  # sink mode: converted, not yet delivered
        self._stream_id = uuid.uuid4().hex[:16]  # batch ids: this stream, then the records before it
        self._retry_size = 0
        self._memory: deque[MetricRecordDict] = deque(maxlen=max_buffer)  # no-sink mode
        self._memory_lock = threading.Lock()
        self._markers: list[tuple[int, _FlushMarker]] = []
        self._buffered_total = 0  # records that entered the buffer (or memory)
        self._handled = 0  # of those, how many are delivered, stored, dropped or discarded

        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._deadline = math.inf
        self._failures = 0  # consecutive failed attempts: how long the next retry waits
        self._next_attempt = 0.0
        self._failing = False

        self._records = 0
        self._sent = 0
        self._dropped_overflow = 0
        self._nonfinite = 0
        self._dropped_invalid = 0
        self._rejected = 0
        self._discarded = 0
        self._failed_attempts = 0
        self._lost_at_close = 0

        self._thread = threading.Thread(target=self._run, name="phalanx-metrics", daemon=True)
        self._thread.start()

    # --- called from other threads ---------------------------------------------------------

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far is delivered (or dropped); False on timeout."""
        if not self._thread.is_alive():
            return self.queue.empty() and not self._buffer
        marker = _FlushMarker()
        self.queue.put(marker)
        self._wake.set()
        if marker.done.wait(timeout):
            return True
        marker.abandoned = True  # stop retrying urgently on behalf of a caller who left
        return False

    def close(self, timeout: float) -> None:
        """Deliver what is pending within `timeout` seconds, then stop the thread."""
        if not self._thread.is_alive():
            return
        self._deadline = time.monotonic() + timeout
        self._stopping.set()
        self._wake.set()
        # Requests are clipped to the deadline, so the thread ends soon after it; the margin
        # covers one conversion pass. It is a daemon either way, so exit is never held up.
        self._thread.join(timeout + 1.0)

    @property
    def records(self) -> list[MetricRecordDict]:
        with self._memory_lock:
            return list(self._memory)

    def stats(self) -> MetricStats:
        return MetricStats(
            records=self._records,
            sent=self._sent,
            pending=len(self._buffer) + self.queue.qsize(),
            dropped_overflow=self._dropped_overflow,
            nonfinite=self._nonfinite,
            dropped_invalid=self._dropped_invalid,
            rejected=self._rejected,
            discarded_superseded=self._discarded,
            failed_attempts=self._failed_attempts,
            lost_at_close=self._lost_at_close,
        )

    # --- the pipeline thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            backlog = False
            while True:
                if not backlog:
                    urgent = self._stopping.is_set() or any(not m.abandoned for _, m in self._markers)
                    self._wake.wait(URGENT_RETRY_S if urgent else self._flush_interval_s)
                    self._wake.clear()
                stopping = self._stopping.is_set()
                backlog = self._drain()
                self._deliver(stopping)
                self._release_markers()
                if stopping and not backlog and (not self._buffer or time.monotonic() >= self._deadline):
                    break
        except Exception:  # a bug here must not take the training run down with it
            logger.exception("phalanx metrics thread failed; further metrics are not sent")
        finally:
            self._lost_at_close = len(self._buffer) + self.queue.qsize()
            if self._lost_at_close:
                logger.warning("phalanx: %d metric records were not delivered", self._lost_at_close)
            for _, marker in self._markers:
                marker.done.set()
            if self._sink is not None:
                self._sink.close()

    def _drain(self) -> bool:
        """Move up to one batch from the queue into the buffer; True if more is waiting."""
        for _ in range(self._max_batch):
            try:
                item = self.queue.get_nowait()
            except Empty:
                return False
            if isinstance(item, _FlushMarker):
                self._markers.append((self._buffered_total, item))
                continue
            record = self._convert(item)
            if record is None:
                continue
            self._records += 1
            self._buffered_total += 1
            if self._sink is None:
                with self._memory_lock:
                    if len(self._memory) == self._memory.maxlen:
                        self._dropped_overflow += 1
                    self._memory.append(record)
                self._handled += 1
            elif self.superseded:
                self._discarded += 1
                self._handled += 1
            else:
                if len(self._buffer) >= self._max_buffer:
                    self._buffer.popleft()
                    self._dropped_overflow += 1
                    self._handled += 1
                self._buffer.append(record)
        return True

    def _convert(self, item: tuple[Any, float, Mapping[Any, Any]]) -> MetricRecordDict | None:
        raw_step, unix_time, raw_values = item
        try:
            step = int(raw_step)  # ints, numpy integers and 0-dim integer tensors
        except (TypeError, ValueError, RuntimeError):
            self._dropped_invalid += 1
            return None
        values: dict[str, float | str] = {}
        for key, raw in raw_values.items():
            if not isinstance(key, str) or isinstance(raw, str | bytes):
                self._dropped_invalid += 1
                continue
            try:
                # float() of a 0-dim tensor is its .item(): the device sync happens here, off the
                # training thread. detach() first: a loss still attached to its graph warns.
                detach = getattr(raw, "detach", None)
                value = float(detach() if callable(detach) else raw)
            except Exception:  # anything that is not a number, including a warning made an error
                self._dropped_invalid += 1
                continue
            if not math.isfinite(value):
                self._nonfinite += 1
                # orjson would write null: the wire's string now, off the hot path of finite values
                values[key] = value if self._sink is None else _wire.token(value)
                continue
            values[key] = value
        if not values:
            return None
        return {"rank": self._rank, "step": step, "time": unix_time, "values": values}

    def _deliver(self, stopping: bool) -> None:
        if self._sink is None or not self._buffer:
            return
        urgent = stopping or any(not m.abandoned for _, m in self._markers)
        if not urgent and time.monotonic() < self._next_attempt:
            return
        while self._buffer:
            timeout = SEND_TIMEOUT_S
            if stopping:
                timeout = min(timeout, self._deadline - time.monotonic())
                if timeout <= 0:
                    return
            # A retry resends exactly the records it sent before, under the same id.
            batch = list(islice(self._buffer, self._retry_size or self._max_batch))
            # (dropping the oldest on overflow shifts the window, and with it the id)
            offset = self._handled + self._dropped_overflow
            outcome = self._sink.send(batch, timeout, f"{self._stream_id}-{offset}")
            if outcome is SendOutcome.RETRY:
                self._retry_size = len(batch)
                self._failed_attempts += 1
                if not self._failing:
                    logger.warning("phalanx: cannot send metrics yet; retrying with backoff")
                    self._failing = True
                self._failures += 1
                self._next_attempt = time.monotonic() + retry_delay(
                    self._failures, self._sink.retry_after, MAX_BACKOFF_S
                )
                return
            self._retry_size = 0
            if self._failing:
                logger.info("phalanx: metrics are flowing again")
                self._failing = False
            self._failures = 0
            if outcome is SendOutcome.SUPERSEDED:
                logger.error("phalanx: this allocation was superseded by a newer attempt; stopping")
                self.superseded = True
                self._discarded += len(self._buffer)
                self._handled += len(self._buffer)
                self._buffer.clear()
                return
            for _ in batch:
                self._buffer.popleft()
            self._handled += len(batch)
            if outcome is SendOutcome.DELIVERED:
                self._sent += len(batch)
            else:
                self._rejected += len(batch)

    def _release_markers(self) -> None:
        waiting: list[tuple[int, _FlushMarker]] = []
        for threshold, marker in self._markers:
            if self._handled >= threshold:
                marker.done.set()
            elif not marker.abandoned:
                waiting.append((threshold, marker))
        self._markers = waiting
