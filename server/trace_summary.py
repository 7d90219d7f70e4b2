"""What one rank's torch.profiler trace says about its steps: compute, communication, their
overlap, and idle time, per step. The definitions follow Holistic Trace Analysis' temporal
breakdown and communication/computation overlap, extended to CPU-only ranks:

- the window is the union of the trace's `ProfilerStep#N` spans (the steps the profiler was asked
  to record), or every event's span when it has none;
- on a GPU (the trace has kernels) compute is the union of the non-NCCL kernels and communication
  the union of the NCCL kernels;
- on a CPU, compute is the union of the operators on the training thread (the one that ran the
  `ProfilerStep#N` spans) and communication the union of the collectives (`gloo:`, `c10d::`, ...)
  on any thread: gloo runs an all-reduce on its own threads while the backward pass goes on;
- overlap is the time both ran, exposed communication is communication less overlap, and idle
  is the window less the time either ran.

The trace is read as a stream (ijson) from its gzipped bytes, with caps on the unpacked size and
the event count, so a large or hostile upload costs bounded memory: only the spans are kept, as
pairs of floats.
"""

from __future__ import annotations

import gzip
import io
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, BinaryIO

import ijson

from phalanx import schemas

MAX_UNPACKED_BYTES = 512 * 1024 * 1024
MAX_EVENTS = 1_000_000  # ~230 MiB of spans at most: what one upload may cost the server
STEP_PREFIX = "ProfilerStep#"
# Collectives as the profiler names them on the host: torch's dispatch of a c10d op, and each
# backend's own record of the work (gloo runs it on its own threads, NCCL on the device).
COMM_NAME_PREFIXES = ("c10d::", "gloo:", "nccl:", "mpi:", "ucc:", "record_param_comms")
HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation"})

Span = tuple[float, float]


class TraceRefused(ValueError):
    """The upload is not a gzipped Chrome trace within the caps; the message says what to do."""


def read_events(trace: BinaryIO, max_unpacked: int = MAX_UNPACKED_BYTES) -> Iterator[Any]:
    """The `traceEvents` of a gzipped Chrome trace, one at a time."""
    unpacked = _CappedReader(gzip.GzipFile(fileobj=trace, mode="rb"), max_unpacked)
    try:
        yield from ijson.items(unpacked, "traceEvents.item", use_float=True)
    except (OSError, EOFError, ijson.JSONError) as exc:
        raise TraceRefused(f"not a gzipped Chrome trace (torch.profiler's export_chrome_trace): {exc}") from exc


class _CappedReader(io.RawIOBase):
    def __init__(self, inner: gzip.GzipFile, cap: int) -> None:
        self._inner = inner
        self._left = cap
        self._cap = cap

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        chunk = self._inner.read(64 * 1024 if size < 0 else min(size, 64 * 1024))
        self._left -= len(chunk)
        if self._left < 0:
            raise TraceRefused(f"the trace unpacks to more than {self._cap // 2**20} MiB; profile fewer steps")
        return chunk

    def readinto(self, buffer: Any) -> int:
        chunk = self.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)


def summarise_bytes(trace: bytes) -> schemas.TraceSummary:
    return summarise(read_events(io.BytesIO(trace)))


def summarise(events: Iterable[Any]) -> schemas.TraceSummary:
    """The breakdown of one rank's trace (`TraceRefused` when it holds no timed event)."""
    steps: list[Span] = []
    step_threads: dict[Any, int] = defaultdict(int)
    kernels: list[Span] = []
    comm_kernels: list[Span] = []
    host: dict[Any, list[Span]] = defaultdict(list)
    host_comm: dict[Any, list[Span]] = defaultdict(list)
    first_start, last_end, timed = math.inf, -math.inf, False
    for count, event in enumerate(events):
        if count >= MAX_EVENTS:
            raise TraceRefused(f"the trace has more than {MAX_EVENTS:,} events; profile fewer steps")
        span = _span(event)
        if span is None:
            continue
        name, category, thread = str(event.get("name", "")), event.get("cat"), event.get("tid")
        first_start, last_end, timed = min(first_start, span[0]), max(last_end, span[1]), True
        if name.startswith(STEP_PREFIX):
            steps.append(span)
            step_threads[_hashable(thread)] += 1
        elif category == "kernel":
            (comm_kernels if "nccl" in name.lower() else kernels).append(span)
        elif category in HOST_CATEGORIES:
            if name.startswith(COMM_NAME_PREFIXES):
                host_comm[_hashable(thread)].append(span)
            else:
                host[_hashable(thread)].append(span)
    if not timed:
        raise TraceRefused("the trace holds no timed events; was the profiler running during the steps?")

    window = union(steps) if steps else [(first_start, last_end)]
    if kernels or comm_kernels:
        device = "cuda"
        compute = union(kernels)
        comm = union(comm_kernels)
    else:
        device = "cpu"
        comm = union(span for spans in host_comm.values() for span in spans)
        training_thread = (
            max(step_threads, key=lambda t: step_threads[t])
            if step_threads
            else max(host, key=lambda t: length(union(host[t])), default=None)
        )
        # the training thread's own time in collectives (their dispatch) is communication
        compute = subtract(union(host.get(training_thread, [])), union(host_comm.get(training_thread, [])))
    compute, comm = intersect(compute, window), intersect(comm, window)
    overlap = length(intersect(compute, comm))
    total = length(window)
    busy = length(union(compute + comm))
    count = max(len(steps), 1)
    return schemas.TraceSummary(
        device=device,
        steps=len(steps),
        step_time_s=total / count * 1e-6,  # the trace's clock is in microseconds
        compute_s=length(compute) / count * 1e-6,
        comm_s=length(comm) / count * 1e-6,
        overlap_s=overlap / count * 1e-6,
        exposed_comm_s=(length(comm) - overlap) / count * 1e-6,
        idle_s=max(total - busy, 0.0) / count * 1e-6,
    )


def _span(event: Any) -> Span | None:
    if not isinstance(event, Mapping) or event.get("ph") != "X":
        return None
    start, duration = event.get("ts"), event.get("dur")
    if not isinstance(start, (int, float)) or not isinstance(duration, (int, float)) or isinstance(start, bool):
        return None
    start, duration = float(start), float(duration)
    if not (math.isfinite(start) and math.isfinite(duration)) or duration < 0:
        return None
    return (start, start + duration)


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (int, float, str)) or value is None else repr(value)


# --- sets of spans: sorted, disjoint lists --------------------------------------------------


def union(spans: Iterable[Span]) -> list[Span]:
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(spans: Iterable[Span]) -> float:
    return sum(end - start for start, end in spans)


def intersect(a: list[Span], b: list[Span]) -> list[Span]:
    """a ∩ b, both disjoint and sorted."""
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Span], b: list[Span]) -> list[Span]:
    """a less b, both disjoint and sorted."""
    out: list[Span] = []
    j = 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out
