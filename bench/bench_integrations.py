"""Steady step rate through each framework integration vs the same framework under plain torchrun.

    python bench/bench_integrations.py [--backend embedded|postgres] [--repeat 3]
                                       [--only lightning,transformers,fsdp]

Each workload runs as 2 nodes x 1 rank, the bench_ddp_throughput method: plain torchrun (static
rendezvous on loopback, OMP_NUM_THREADS=1, no PHALANX_* variables) against the same job submitted
to a running stack, in pairs whose order alternates; the figure is median(Phalanx) / median(plain)
of rank 0's `phalanx-steps-per-second`, goal >= 0.98.

- lightning: bench/frameworks/train.py, the digits MLP as a LightningModule; plain Lightning DDP
  against `**pxl.trainer_kwargs()` + `ckpt_path=pxl.ckpt_path()` (Phalanx's logger, checkpoint IO
  and stop callback). Rates from a Lightning callback on both sides.
- transformers: bench/frameworks/train.py, a small GPT-2 under Hugging Face's Trainer; plain
  `TrainingArguments` against `pxt.training_args` + `pxt.callback()` + `pxt.resume_path()`.
- fsdp: examples/gpt/train.py with `strategy: fsdp` (FSDP2, sharded DCP checkpoints every 25
  steps), the same script under plain torchrun and on Phalanx.

Prints one JSON line: a row per workload.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (
    REPO,
    RunningStack,
    interleave,
    median,
    phalanx_job_output,
    plain_torchrun_nodes,
    steps_per_second,
)
from phalanx.schemas import JobSpec

GOAL_RATIO = 0.98
FRAMEWORKS = REPO / "bench" / "frameworks"
GPT = REPO / "examples" / "gpt"
FSDP_HPARAMS = {"strategy": "fsdp", "batch_size": 4, "grad_accum": 2, "checkpoint_every": 25}


def framework_workload(framework: str, steps: int) -> tuple[Callable[[], float], Callable[[RunningStack], float]]:
    def plain() -> float:
        with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:  # the frameworks write logs beside it
            workdir = Path(shutil.copytree(FRAMEWORKS, Path(tmp) / "frameworks"))
            text = plain_torchrun_nodes(workdir, ["train.py", framework, f"--steps={steps}"])
        return steps_per_second(text, f"plain {framework}")

    def phalanx(running: RunningStack) -> float:
        spec = JobSpec(
            name=f"bench-{framework}",
            entrypoint=f"python train.py {framework} --phalanx --steps {steps}",
            resources={"nodes": 2, "slots_per_node": 1},
            checkpoint={"keep_last": 1},
        )
        return steps_per_second(phalanx_job_output(running, spec, FRAMEWORKS), f"{framework} on Phalanx")

    return plain, phalanx


def fsdp_workload(steps: int) -> tuple[Callable[[], float], Callable[[RunningStack], float]]:
    def plain() -> float:
        env = {"PHALANX_HPARAMS": json.dumps(FSDP_HPARAMS)}
        with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:  # checkpoints land in a temp folder
            env["PHALANX_CHECKPOINT_ROOT"] = f"file://{tmp}"
            text = plain_torchrun_nodes(GPT, ["train.py", f"--steps={steps}"], **env)
        return steps_per_second(text, "plain FSDP")

    def phalanx(running: RunningStack) -> float:
        spec = JobSpec(
            name="bench-fsdp",
            entrypoint=f"python train.py --steps {steps}",
            resources={"nodes": 2, "slots_per_node": 1},
            hyperparameters=FSDP_HPARAMS,
            checkpoint={"keep_last": 1},
        )
        return steps_per_second(phalanx_job_output(running, spec, GPT), "FSDP on Phalanx")

    return plain, phalanx


WORKLOADS: dict[str, Callable[[], tuple[Callable[[], float], Callable[[RunningStack], float]]]] = {
    "lightning": lambda: framework_workload("lightning", 2000),
    "transformers": lambda: framework_workload("transformers", 400),
    "fsdp": lambda: fsdp_workload(150),
}


def run(backend: str = "embedded", repeat: int = 3, only: list[str] | None = None) -> dict[str, object]:
    rows = []
    for name in only or list(WORKLOADS):
        plain_side, phalanx_side = WORKLOADS[name]()
        plain, phalanx, failures = interleave(backend, repeat, plain_side, phalanx_side)
        ratio = median(phalanx) / median(plain)
        rows.append(
            {
                "workload": name,
                "phalanx_steps_per_second": round(median(phalanx), 2),
                "plain_steps_per_second": round(median(plain), 2),
                "ratio": round(ratio, 3),
                "median_pair_ratio": round(median([p / q for p, q in zip(phalanx, plain, strict=True)]), 3),
                "ok": ratio >= GOAL_RATIO,
                "phalanx_runs": phalanx,
                "plain_runs": plain,
                "stack_failures": failures,
            }
        )
    return {
        "bench": "integrations",
        "backend": backend,
        "repeat": repeat,
        "goal_ratio": GOAL_RATIO,
        "ok": all(row["ok"] for row in rows),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("embedded", "postgres"), default="embedded")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", type=lambda text: text.split(","), help=f"some of {', '.join(WORKLOADS)}")
    args = parser.parse_args(argv)
    if args.only and set(args.only) - set(WORKLOADS):
        parser.error(f"--only: choose among {', '.join(WORKLOADS)}")
    report = run(args.backend, args.repeat, args.only)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
