"""GPU step rates through Phalanx vs plain torchrun: digits (DDP) and the small GPT (DDP, FSDP),
NCCL and bf16. Run by bench/gpu_check.sh on a machine with NVIDIA GPUs.

    python bench/bench_gpu.py [--repeat 3] [--only digits,gpt-ddp,gpt-fsdp] [--cpu-smoke]

One node with every GPU it has: plain `torchrun --standalone --nproc-per-node <GPUs>` against
the same script submitted as a 1 node x <GPUs> gpu-slot job to an embedded stack (one agent, its
GPUs detected by nvidia-smi), `precision: bf16-mixed` on both sides (PHALANX_PRECISION for plain
torchrun). Pairs alternate their order; the figure is median(Phalanx) / median(plain) of rank 0's
`phalanx-steps-per-second`, goal >= 0.98. The GPT is sized for a GPU (6 blocks of 384, 256
characters of context) so a step is not all launch overhead.

`--cpu-smoke` runs the same code path with 2 CPU ranks, tiny sizes and precision 32: a check that
the script works, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (
    REPO,
    BenchError,
    RunningStack,
    embedded_stack,
    log,
    median,
    phalanx_job_output,
    plain_torchrun_nodes,
    steps_per_second,
)
from phalanx.schemas import JobSpec

GOAL_RATIO = 0.98
GPT_ON_GPU = {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "batch_size": 32, "grad_accum": 2}
GPT_SMOKE = {"batch_size": 4, "grad_accum": 2}


def gpu_count() -> int:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


class Workload:
    def __init__(self, folder: str, args: list[str], hparams: dict[str, object] | None = None) -> None:
        self.workdir = REPO / "examples" / folder
        self.args = args
        self.hparams = hparams or {}


def workloads(smoke: bool) -> dict[str, Workload]:
    gpt = GPT_SMOKE if smoke else GPT_ON_GPU
    steps = "40" if smoke else "300"
    return {
        "digits": Workload("digits", ["train.py", "--epochs", "5" if smoke else "60", "--checkpoint-every", "25"]),
        "gpt-ddp": Workload("gpt", ["train.py", "--steps", steps], {**gpt, "strategy": "ddp"}),
        "gpt-fsdp": Workload("gpt", ["train.py", "--steps", steps], {**gpt, "strategy": "fsdp"}),
    }


def plain_rate(name: str, work: Workload, ranks: int, precision: str) -> float:
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        env = {"PHALANX_PRECISION": precision, "PHALANX_CHECKPOINT_ROOT": f"file://{tmp}"}
        if work.hparams:
            env["PHALANX_HPARAMS"] = json.dumps(work.hparams)
        text = plain_torchrun_nodes(work.workdir, work.args, nodes=1, per_node=ranks, **env)
    return steps_per_second(text, f"plain {name}")


def phalanx_rate(name: str, work: Workload, running: RunningStack, ranks: int, slot_type: str, precision: str) -> float:
    spec = JobSpec(
        name=f"gpu-{name}",
        entrypoint=" ".join(["python", *work.args]),
        resources={"nodes": 1, "slots_per_node": ranks, "slot_type": slot_type},
        hyperparameters=work.hparams,
        precision=precision,
        checkpoint={"keep_last": 1},
    )
    return steps_per_second(phalanx_job_output(running, spec, work.workdir, timeout=900), f"{name} on Phalanx")


@contextmanager
def one_agent(ranks: int, smoke: bool) -> Iterator[RunningStack]:
    with embedded_stack(agents=1, cpu_slots=ranks if smoke else 1) as running:
        yield running


def run(repeat: int, only: list[str] | None, smoke: bool) -> dict[str, object]:
    ranks = 2 if smoke else gpu_count()
    if ranks == 0:
        raise BenchError("nvidia-smi lists no GPU: run this on a GPU machine, or pass --cpu-smoke")
    slot_type, precision = ("cpu", "32") if smoke else ("gpu", "bf16-mixed")
    rows = []
    chosen = workloads(smoke)
    with one_agent(ranks, smoke) as running:
        for name in only or list(chosen):
            plain_runs, phalanx_runs = [], []
            work = chosen[name]
            for i in range(repeat):
                figures: dict[str, float] = {}
                for side in ("plain", "phalanx") if i % 2 == 0 else ("phalanx", "plain"):  # alternate the order
                    if side == "plain":
                        figures[side] = plain_rate(name, work, ranks, precision)
                    else:
                        figures[side] = phalanx_rate(name, work, running, ranks, slot_type, precision)
                plain, phalanx = figures["plain"], figures["phalanx"]
                plain_runs.append(plain)
                phalanx_runs.append(phalanx)
                log(f"{name} {i + 1}/{repeat}: plain {plain:.2f}, phalanx {phalanx:.2f} steps/s")
            ratio = median(phalanx_runs) / median(plain_runs)
            rows.append(
                {
                    "workload": name,
                    "phalanx_steps_per_second": round(median(phalanx_runs), 2),
                    "plain_steps_per_second": round(median(plain_runs), 2),
                    "ratio": round(ratio, 3),
                    "ok": ratio >= GOAL_RATIO,
                    "phalanx_runs": phalanx_runs,
                    "plain_runs": plain_runs,
                }
            )
    return {
        "bench": "gpu",
        "gpus": 0 if smoke else ranks,
        "smoke": smoke,
        "precision": precision,
        "goal_ratio": GOAL_RATIO,
        "ok": all(row["ok"] for row in rows),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", type=lambda text: text.split(","), help="some of digits, gpt-ddp, gpt-fsdp")
    parser.add_argument("--cpu-smoke", action="store_true", help="2 CPU ranks, tiny sizes: does the script work")
    args = parser.parse_args(argv)
    if args.only and set(args.only) - set(workloads(True)):
        parser.error("--only: choose among digits, gpt-ddp, gpt-fsdp")
    report = run(args.repeat, args.only, args.cpu_smoke)
    print(json.dumps(report))
    return 0 if report["ok"] or args.cpu_smoke else 1


if __name__ == "__main__":
    sys.exit(main())
