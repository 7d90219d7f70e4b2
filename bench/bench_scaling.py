"""Scaling efficiency of the digits and small-GPT examples at 1 and 2 nodes, through
`phalanx jobs scaling` (a scaling run on the server) on a running stack of two one-slot agents.

    python bench/bench_scaling.py [--backend embedded|postgres] [--warmup 20] [--only digits,gpt]

Each size is a job run for `warmup + steps` steps and then killed; the rate is rank 0's over the
measured steps. Throughput = steps/s x ranks; efficiency = throughput(2) / (2 x throughput(1));
the communication share is the 2-node job's exposed all-reduce time / step time. On this
machine both nodes share two cores, so 2 nodes cannot be faster than 1 per core: the table says
what communication costs here, not what a network of separate machines would give. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import REPO, digits_spec, log, stack
from phalanx.client import load_job_file
from phalanx.schemas import JobSpec

# Steps measured per size: several seconds at each, so that the ranks' communication figures
# (2 s in, then every 5 s) arrive before the kill.
STEPS = {"digits": 3000, "gpt": 150}


def workloads() -> dict[str, tuple[JobSpec, Path]]:
    digits, digits_dir = digits_spec(epochs=10_000, checkpoint_every=10_000)  # runs until measured
    gpt, gpt_dir = load_job_file(REPO / "examples" / "gpt" / "job.yaml")
    gpt = gpt.model_copy(update={"entrypoint": "python train.py --steps 100000"})
    return {"digits": (digits, digits_dir), "gpt": (gpt, gpt_dir)}


def run(backend: str = "embedded", warmup: int = 20, only: list[str] | None = None) -> dict[str, object]:
    rows = []
    chosen = {name: job for name, job in workloads().items() if only is None or name in only}
    with stack(backend) as running:
        for name, (spec, workdir) in chosen.items():
            points = running.client.scaling(spec, workdir, [1, 2], steps=STEPS[name], warmup=warmup)
            log(f"{name}: " + ", ".join(f"{p.nodes} node(s) {p.steps_per_second:.2f} steps/s" for p in points))
            rows.append({"workload": name, "steps": STEPS[name], "points": [p.model_dump(mode="json") for p in points]})
    return {"bench": "scaling", "backend": backend, "warmup": warmup, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("embedded", "postgres"), default="embedded")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--only", help="a comma-separated subset of: digits, gpt")
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else None
    print(json.dumps(run(args.backend, args.warmup, only)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
