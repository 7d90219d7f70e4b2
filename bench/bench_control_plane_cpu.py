"""CPU seconds the control plane (server, scheduler, agents) spends while one digits job trains on
the embedded stack: what training shares its cores with, beyond the ranks themselves.

    python bench/bench_control_plane_cpu.py [--epochs 100] [--checkpoint-every 25]

One warm-up run, then one measured run; prints one JSON line with each component's CPU seconds
(psutil, user + system) over the measured run, and that run's steps per second.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import psutil

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import embedded_stack, phalanx_run


def cpu_by_component() -> dict[int, tuple[str, float]]:
    out = {}
    for process in psutil.Process().children(recursive=True):
        try:
            times = process.cpu_times()
            out[process.pid] = (" ".join(process.cmdline()[2:4]), times.user + times.system)
        except psutil.Error:
            continue
    return out


def run(epochs: int = 100, checkpoint_every: int = 25) -> dict[str, object]:
    with embedded_stack() as running:
        phalanx_run(running, epochs, checkpoint_every=checkpoint_every)  # warm-up
        before = cpu_by_component()
        measured = phalanx_run(running, epochs, checkpoint_every=checkpoint_every)
        after = cpu_by_component()
    totals: collections.Counter[str] = collections.Counter()
    for pid, (name, cpu) in after.items():
        if name.startswith("stack "):  # the stack's own components; ranks come and go
            totals[name.removeprefix("stack ")] += cpu - before.get(pid, (name, 0.0))[1]
    return {
        "bench": "control_plane_cpu",
        "steps_per_second": measured.steps_per_second,
        "cpu_seconds": {name: round(cpu, 3) for name, cpu in totals.most_common()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=25)
    args = parser.parse_args()
    print(json.dumps(run(args.epochs, args.checkpoint_every)))


if __name__ == "__main__":
    main()
