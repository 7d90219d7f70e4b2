"""How much does `ctx.report()` cost the training thread while the sender is busy?

Goal: a median of at most 20 µs per call. The baseline is a bare `queue.SimpleQueue().put` of
the same item, measured in the same run, so the ratio holds on any machine.

    python bench/bench_report.py    # prints one JSON line
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from queue import SimpleQueue
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import phalanx.train as pt

CALLS = 100_000
GOAL_MEDIAN_US = 20.0


class _Sink(BaseHTTPRequestHandler):
    """Accepts metric POSTs and counts their records, like a fast server would."""

    records = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with _Sink.lock:
            _Sink.records += len(body["records"])
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _percentiles(durations_ns: list[int]) -> tuple[float, float]:
    ordered = sorted(durations_ns)
    return ordered[len(ordered) // 2] / 1000, ordered[int(len(ordered) * 0.99)] / 1000


def run() -> dict[str, object]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PHALANX_") or k == "WORLD_SIZE"}
    os.environ.update(
        PHALANX_URL=f"http://127.0.0.1:{server.server_address[1]}",
        PHALANX_TOKEN="bench",
        PHALANX_ALLOCATION_ID="1",
    )
    _Sink.records = 0
    try:
        ctx = pt.init()
        loss = torch.tensor(0.5)  # a training loop reports tensors; reading them is the sender's job
        clock = time.perf_counter_ns

        # Baseline: the cheapest possible hand-off of the same item to another thread.
        baseline_queue: SimpleQueue[object] = SimpleQueue()
        baseline_put = baseline_queue.put
        baseline = [0] * CALLS
        for step in range(CALLS):
            values = {"loss": loss, "accuracy": 0.9}
            start = clock()
            baseline_put((step, time.time(), values))
            baseline[step] = clock() - start

        measured = [0] * CALLS
        report = ctx.report
        started = time.perf_counter()
        for step in range(CALLS):
            values = {"loss": loss, "accuracy": 0.9}
            start = clock()
            report(values, step=step)
            measured[step] = clock() - start
        loop_seconds = time.perf_counter() - started

        flush_started = time.perf_counter()
        delivered_all = ctx.flush(timeout=60)
        flush_seconds = time.perf_counter() - flush_started
        stats = ctx.metric_stats()
        ctx.finish()
    finally:
        server.shutdown()
        server.server_close()
        for key in ("PHALANX_URL", "PHALANX_TOKEN", "PHALANX_ALLOCATION_ID"):
            os.environ.pop(key, None)
        os.environ.update(saved)

    median_us, p99_us = _percentiles(measured)
    baseline_median_us, baseline_p99_us = _percentiles(baseline)
    return {
        "bench": "report",
        "calls": CALLS,
        "median_us": round(median_us, 3),
        "p99_us": round(p99_us, 3),
        "goal_median_us": GOAL_MEDIAN_US,
        "ok": median_us <= GOAL_MEDIAN_US and delivered_all and stats.sent == CALLS,
        "baseline": "queue.SimpleQueue().put",
        "baseline_median_us": round(baseline_median_us, 3),
        "baseline_p99_us": round(baseline_p99_us, 3),
        "ratio_median": round(median_us / baseline_median_us, 2),
        "loop_calls_per_second": round(CALLS / loop_seconds),
        "delivered": stats.sent,
        "delivered_by_server": _Sink.records,
        "flush_seconds_after_loop": round(flush_seconds, 3),
    }


if __name__ == "__main__":
    print(json.dumps(run()))
