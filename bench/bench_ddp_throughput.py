"""DDP training throughput of examples/digits/train.py through Phalanx vs plain torchrun.

    python bench/bench_ddp_throughput.py [--backend embedded|postgres] [--repeat 5] [--epochs 100]
                                         [--checkpoint-every 25]

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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import interleave, median, phalanx_run, plain_torchrun

GOAL_RATIO = 0.98
# 100 epochs x 23 steps at 300-450 steps/s: 5-8 s of training per run on this machine.
DEFAULT_EPOCHS = 100
DEFAULT_CHECKPOINT_EVERY = 25


def run(
    backend: str = "embedded",
    repeat: int = 5,
    epochs: int = DEFAULT_EPOCHS,
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
) -> dict[str, object]:
    plain, phalanx, failures = interleave(
        backend,
        repeat,
        lambda: plain_torchrun(epochs, checkpoint_every=checkpoint_every).steps_per_second,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("embedded", "postgres"), default="embedded")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--checkpoint-every", type=int, default=DEFAULT_CHECKPOINT_EVERY, metavar="EPOCHS")
    args = parser.parse_args(argv)
    report = run(args.backend, args.repeat, args.epochs, args.checkpoint_every)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
