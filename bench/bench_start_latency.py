"""Submit -> first training step through Phalanx vs launch -> first step under plain torchrun.

    python bench/bench_start_latency.py [--backend embedded|postgres|both] [--repeat 5]

Baseline: two plain torchrun processes (2 nodes x 1 rank, static rendezvous on 127.0.0.1), timed
from just before the first Popen to the `phalanx-first-step` time rank 0 prints. Phalanx: from just
before `client.submit()` to the same line in rank 0's logs, with the stack up and its two agents
registered. Runs alternate (plain, Phalanx, ...); the figure per backend is
median(Phalanx) - median(plain), goal <= +1.0 s embedded and <= +1.5 s on PostgreSQL + Redis.
One stack at a time. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import interleave, median, phalanx_run, plain_torchrun

GOAL_OVERHEAD_S = {"embedded": 1.0, "postgres": 1.5}
EPOCHS = 1  # only the first step matters; a short run keeps the next launch off a busy machine


def measure(backend: str, repeat: int) -> dict[str, object]:
    plain, phalanx, failures = interleave(
        backend,
        repeat,
        lambda: plain_torchrun(EPOCHS).start_latency,
        lambda running: phalanx_run(running, EPOCHS).start_latency,
    )
    overhead = median(phalanx) - median(plain)
    return {
        "phalanx_s": round(median(phalanx), 3),
        "plain_s": round(median(plain), 3),
        "overhead_s": round(overhead, 3),
        "goal_overhead_s": GOAL_OVERHEAD_S[backend],
        "ok": overhead <= GOAL_OVERHEAD_S[backend],
        "phalanx_runs": [round(s, 3) for s in phalanx],
        "plain_runs": [round(s, 3) for s in plain],
        "stack_failures": failures,
    }


def run(backend: str = "both", repeat: int = 5) -> dict[str, object]:
    backends = ("embedded", "postgres") if backend == "both" else (backend,)
    results = {name: measure(name, repeat) for name in backends}  # one stack after the other
    return {
        "bench": "start_latency",
        "repeat": repeat,
        **{f"{name}_overhead_s": result["overhead_s"] for name, result in results.items()},
        "goal_overhead_s": {name: GOAL_OVERHEAD_S[name] for name in backends},
        "ok": all(result["ok"] for result in results.values()),
        **results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("embedded", "postgres", "both"), default="both")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    report = run(args.backend, args.repeat)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
