"""Submit -> first training step through Phalanx vs launch -> first step under plain torchrun.

    python bench/bench_start_latency.py [--backend embedded|postgres|both] [--repeat 5]
    python bench/bench_start_latency.py --back-to-back 10 [--backend embedded]

Baseline: two plain torchrun processes (2 nodes x 1 rank, static rendezvous on 127.0.0.1), timed
from just before the first Popen to the `phalanx-first-step` time rank 0 prints. Phalanx: from just
before `client.submit()` to the same line in rank 0's logs, with the stack up and its two agents
registered. Runs alternate (plain, Phalanx, ...); the figure per backend is
median(Phalanx) - median(plain), goal <= +1.0 s embedded and <= +1.5 s on PostgreSQL + Redis.
One stack at a time. Prints one JSON line.

--back-to-back N: N Phalanx jobs, each submitted the moment the one before completed (what a queue
of jobs or a study's trials does to an agent), against N plain torchruns run the same way; both
blocks twice, alternating (plain, Phalanx, Phalanx, plain). Goal: median Phalanx start ≤ 0.8x
median plain (issue 15: every start warm, not only the first two after an idle spell).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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
        "ratio": round(median(phalanx) / median(plain), 3),
        "goal_overhead_s": GOAL_OVERHEAD_S[backend],
        "ok": overhead <= GOAL_OVERHEAD_S[backend],
        "phalanx_runs": [round(s, 3) for s in phalanx],
        "plain_runs": [round(s, 3) for s in plain],
        "stack_failures": failures,
    }


GOAL_BACK_TO_BACK_RATIO = 0.8


def back_to_back(backend: str, count: int) -> dict[str, object]:
    from bench._common import SETTLE_S, log, stack, wait_quiet

    plain: list[float] = []
    phalanx: list[float] = []
    with stack(backend) as running:
        for side in ("plain", "phalanx", "phalanx", "plain"):
            wait_quiet(running.pids)
            time.sleep(SETTLE_S)
            for _ in range(count):  # no pause between the jobs of a block
                if side == "plain":
                    plain.append(plain_torchrun(EPOCHS).start_latency)
                else:
                    phalanx.append(phalanx_run(running, EPOCHS).start_latency)
            block = (plain if side == "plain" else phalanx)[-count:]
            log(f"{backend} back-to-back {side}: {[round(s, 2) for s in block]}")
    ratio = median(phalanx) / median(plain)
    return {
        "bench": "start_latency_back_to_back",
        "backend": backend,
        "jobs_per_block": count,
        "phalanx_s": round(median(phalanx), 3),
        "plain_s": round(median(plain), 3),
        "ratio": round(ratio, 3),
        "goal_ratio": GOAL_BACK_TO_BACK_RATIO,
        "ok": ratio <= GOAL_BACK_TO_BACK_RATIO,
        "phalanx_runs": [round(s, 3) for s in phalanx],
        "plain_runs": [round(s, 3) for s in plain],
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
    parser.add_argument("--back-to-back", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    if args.back_to_back:
        report = back_to_back("embedded" if args.backend == "both" else args.backend, args.back_to_back)
    else:
        report = run(args.backend, args.repeat)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
