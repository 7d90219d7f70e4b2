"""What summarising a rank's profiler trace costs the server (`server/trace_summary.py`): time and
peak memory of the streaming summary against loading the whole document with orjson first (the
obvious way), on the same synthetic gzipped trace, in the same process.

    python bench/bench_trace_summary.py [--events 400000] [--repeat 3]

The trace has the shape torch.profiler writes for a CPU rank: a `ProfilerStep#N` span per step,
operators on the training thread with their args, `gloo:all_reduce` spans on gloo's thread (about
250 bytes an event). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson

from server.trace_summary import summarise, summarise_bytes


def synthetic_trace(events: int) -> bytes:
    """A gzipped trace of about `events` events: 100 operators and 2 all-reduces per step."""
    out: list[dict[str, Any]] = []
    step, ts = 0, 0.0
    while len(out) < events:
        out.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step}",
                "pid": 1,
                "tid": 1,
                "ts": ts,
                "dur": 10_000.0,
                "args": {"External id": step},
            }
        )
        for op in range(100):
            out.append(
                {
                    "ph": "X",
                    "cat": "cpu_op",
                    "name": f"aten::op{op % 17}",
                    "pid": 1,
                    "tid": 1,
                    "ts": ts + op * 80.0,
                    "dur": 60.0,
                    "args": {"External id": len(out), "Record function id": 0, "Ev Idx": len(out)},
                }
            )
        for bucket in range(2):
            out.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": "gloo:all_reduce",
                    "pid": 1,
                    "tid": 2 + bucket,
                    "ts": ts + 6_000.0 + bucket * 1_000.0,
                    "dur": 2_500.0,
                    "args": {"External id": len(out)},
                }
            )
        step, ts = step + 1, ts + 10_000.0
    return gzip.compress(json.dumps({"schemaVersion": 1, "traceEvents": out}, indent=1).encode(), compresslevel=6)


def whole_document(trace: bytes) -> Any:
    return summarise(orjson.loads(gzip.decompress(trace))["traceEvents"])


def measure(fn: Any, trace: bytes) -> tuple[float, float]:
    """(seconds, peak MiB allocated while it ran): timed on its own, then run again under
    tracemalloc (which slows every allocation) for the memory."""
    gc.collect()
    started = time.perf_counter()
    fn(trace)
    elapsed = time.perf_counter() - started
    gc.collect()
    tracemalloc.start()
    fn(trace)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return elapsed, peak / 2**20


def run(events: int, repeat: int) -> dict[str, object]:
    trace = synthetic_trace(events)
    unpacked = len(gzip.decompress(trace))
    assert summarise_bytes(trace) == whole_document(trace)  # the same answer both ways
    streaming, loaded = [], []
    for _ in range(repeat):  # alternate, so that drift on the machine lands on both
        streaming.append(measure(summarise_bytes, trace))
        loaded.append(measure(whole_document, trace))
    s_time = statistics.median(t for t, _ in streaming)
    l_time = statistics.median(t for t, _ in loaded)
    s_peak = max(p for _, p in streaming)
    l_peak = max(p for _, p in loaded)
    return {
        "bench": "trace_summary",
        "events": events,
        "gzipped_mib": round(len(trace) / 2**20, 2),
        "unpacked_mib": round(unpacked / 2**20, 1),
        "streaming_s": round(s_time, 3),
        "whole_document_s": round(l_time, 3),
        "time_ratio": round(s_time / l_time, 2),
        "streaming_peak_mib": round(s_peak, 1),
        "whole_document_peak_mib": round(l_peak, 1),
        "memory_ratio": round(s_peak / l_peak, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=400_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.events, args.repeat)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
