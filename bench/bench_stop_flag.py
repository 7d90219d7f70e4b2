"""What `ctx.should_stop()` (agreed by every rank) costs a DDP training step.

    python bench/bench_stop_flag.py [--steps 3000] [--repeat 3]

Two ranks under plain torchrun (gloo, 1 thread each) train a small MLP with DDP for `--steps`
steps, three ways in one process per rank, in rotating order, `--repeat` times:

- none: no stop check at all (the baseline);
- agreed: `ctx.should_stop()` every step (an async all_reduce on its own gloo group, answered one
  call later);
- blocking: what scripts did before, `dist.all_reduce` of the local flag every step, waited for.

Prints one JSON line: steps/s of each (median) and the ratios to `none`; goal: agreed >= 0.98.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

GOAL_RATIO = 0.98
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")

RANK_SCRIPT = """
import json, statistics, sys, time
import torch
import torch.distributed as dist
from torch import nn
import phalanx.train as pt

steps, repeat, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
ctx = pt.init()
torch.manual_seed(0)
model = ctx.prepare_model(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
loss_fn = nn.CrossEntropyLoss()


def train(mode):
    start = time.perf_counter()
    for _ in range(steps):
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if mode == "agreed":
            if ctx.should_stop():
                break
        elif mode == "blocking":
            flag = torch.tensor([1.0 if ctx.stop_requested() else 0.0])
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
    return steps / (time.perf_counter() - start)


modes = ["none", "agreed", "blocking"]
train("none")  # warm-up
rates = {m: [] for m in modes}
for i in range(repeat):
    for m in modes[i % 3:] + modes[: i % 3]:
        rates[m].append(train(m))
ctx.finish()
if ctx.rank == 0:
    with open(out, "w") as handle:
        json.dump({m: statistics.median(r) for m, r in rates.items()}, handle)
"""


def run(steps: int, repeat: int) -> dict[str, object]:
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "stop_flag.py", Path(tmp) / "rates.json"
        script.write_text(textwrap.dedent(RANK_SCRIPT))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
        subprocess.run(
            [*TORCHRUN, str(script), str(steps), str(repeat), str(out)],
            env=env,
            check=True,
            capture_output=True,
        )
        rates = json.loads(out.read_text())
    agreed, blocking = rates["agreed"] / rates["none"], rates["blocking"] / rates["none"]
    return {
        "bench": "stop_flag",
        "steps": steps,
        "repeat": repeat,
        "steps_per_second": {k: round(v, 1) for k, v in rates.items()},
        "agreed_ratio": round(agreed, 3),
        "blocking_ratio": round(blocking, 3),
        "goal_ratio": GOAL_RATIO,
        "ok": agreed >= GOAL_RATIO,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(args.steps, args.repeat)))


if __name__ == "__main__":
    main()
