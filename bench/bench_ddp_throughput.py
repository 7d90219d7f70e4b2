"""DDP training throughput of examples/digits/train.py through Phalanx vs plain torchrun.

    python bench/bench_ddp_throughput.py [--backend embedded|postgres] [--repeat 5] [--epochs 100]
                                         [--checkpoint-every 25] [--timing]

Baseline: two plain torchrun processes (2 nodes x 1 rank, static rendezvous on 127.0.0.1,
--max-restarts 0, OMP_NUM_THREADS=1, no PHALANX_* variables). Phalanx: the same script submitted
as a 2 nodes x 1 cpu slot job to a running stack, its metrics shipped to the server as it trains.
Runs come in pairs (plain then Phalanx, then Phalanx then plain, ...); the figure is
median(Phalanx) / median(plain) of rank 0's `phalanx-steps-per-second`, goal >= 0.98. The median
of the per-pair ratios is printed beside it: the machine's speed drifts by more than the effect
measured here, and a pair's two runs share the same moment. Prints one JSON line.

Both report loss and accuracy every step and checkpoint every `--checkpoint-every` epochs (25:
four checkpoints in a run, one every ~1.3 s at these rates, still far more often than real training
checkpoints). `--checkpoint-every 1` is a stress case: an epoch here lasts ~50 ms, so that is ~20
checkpoint commits a second, each a database transaction on the same two cores.

The plain side runs without the communication figures (`ddp: {timing: false}`, as PHALANX_DDP):
torchrun and the script, nothing of Phalanx's. `--timing` adds a third run to every round, the
Phalanx job with `ddp: {timing: false}`, so that the figures' own cost shows as the ratio of the
two Phalanx sides of the same rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import SETTLE_S, interleave, log, median, phalanx_run, plain_torchrun, stack, wait_quiet

GOAL_RATIO = 0.98
# 100 epochs x 23 steps at 300-450 steps/s: 5-8 s of training per run on this machine.
DEFAULT_EPOCHS = 100
DEFAULT_CHECKPOINT_EVERY = 25
NO_TIMING = json.dumps({"timing": False})  # PHALANX_DDP for the plain side


def run(
    backend: str = "embedded",
    repeat: int = 5,
    epochs: int = DEFAULT_EPOCHS,
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
) -> dict[str, object]:
    plain, phalanx, failures = interleave(
        backend,
        repeat,
        lambda: plain_torchrun(epochs, checkpoint_every=checkpoint_every, PHALANX_DDP=NO_TIMING).steps_per_second,
        lambda running: phalanx_run(running, epochs, checkpoint_every=checkpoint_every).steps_per_second,
    )
    ratio = median(phalanx) / median(plain)
    pair_ratio = median([p / q for p, q in zip(phalanx, plain, strict=True)])
    return {
        "bench": "ddp_throughput",
        "backend": backend,
        "epochs": epochs,
        "checkpoint_every": checkpoint_every,
        "repeat": repeat,
        "phalanx_steps_per_second": round(median(phalanx), 1),
        "plain_steps_per_second": round(median(plain), 1),
        "ratio": round(ratio, 3),
        "median_pair_ratio": round(pair_ratio, 3),
        "goal_ratio": GOAL_RATIO,
        "ok": ratio >= GOAL_RATIO,
        "phalanx_runs": phalanx,
        "plain_runs": plain,
        "stack_failures": failures,
    }


def run_timing(
    backend: str = "embedded",
    repeat: int = 5,
    epochs: int = DEFAULT_EPOCHS,
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
    warmup_rounds: int = 1,
) -> dict[str, object]:
    """Rounds of three runs on one stack, their order rotating: plain, Phalanx with the
    communication figures (the default), Phalanx without them. The first `warmup_rounds` are run
    and left out: a fresh stack's first minute (its workers' first tasks, the database's first
    pages, the fork-server's first forks) slowed the first Phalanx runs by up to a third, and
    what a job pays to start is `bench_start_latency.py`'s row, not this one's."""
    no_timing = {"ddp": {"timing": False}}
    sides = ["plain", "timing", "no_timing"]
    runs: dict[str, list[float]] = {side: [] for side in sides}
    with stack(backend) as running:
        for round_number in range(-warmup_rounds, repeat):
            order = sides[round_number % 3 :] + sides[: round_number % 3]
            for side in order:
                wait_quiet(running.pids)
                time.sleep(SETTLE_S)
                if side == "plain":
                    figure = plain_torchrun(epochs, checkpoint_every=checkpoint_every, PHALANX_DDP=NO_TIMING)
                else:
                    update = None if side == "timing" else no_timing
                    figure = phalanx_run(running, epochs, checkpoint_every=checkpoint_every, spec_update=update)
                runs[side].append(figure.steps_per_second)
            if round_number < 0:
                log(f"{backend} warm-up round: " + ", ".join(f"{s} {runs[s].pop():.1f}" for s in sides))
                continue
            log(f"{backend} {round_number + 1}/{repeat}: " + ", ".join(f"{s} {runs[s][-1]:.1f}" for s in sides))
    timing, bare, plain = (median(runs[s]) for s in ("timing", "no_timing", "plain"))
    return {
        "bench": "ddp_throughput_timing",
        "backend": backend,
        "repeat": repeat,
        "steps_per_second": {side: round(median(values), 1) for side, values in runs.items()},
        "timing_vs_plain": round(timing / plain, 3),
        "no_timing_vs_plain": round(bare / plain, 3),
        "timing_vs_no_timing": round(timing / bare, 3),
        "goal_ratio": GOAL_RATIO,
        "ok": timing / plain >= GOAL_RATIO,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("embedded", "postgres"), default="embedded")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--checkpoint-every", type=int, default=DEFAULT_CHECKPOINT_EVERY, metavar="EPOCHS")
    parser.add_argument("--timing", action="store_true", help="also run Phalanx without the communication figures")
    args = parser.parse_args(argv)
    measure = run_timing if args.timing else run
    report = measure(args.backend, args.repeat, args.epochs, args.checkpoint_every)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
