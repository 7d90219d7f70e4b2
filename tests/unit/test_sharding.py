"""FSDP2 through `ctx.prepare_model(strategy="fsdp")` and sharded checkpoints through DCP, as 2
ranks under torchrun on gloo (outside Phalanx: checkpoints under PHALANX_CHECKPOINT_ROOT, a resume
point given the way the agent gives it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import phalanx.train as pt
from tests.unit.test_train_api import TORCHRUN, subprocess_env

SCRIPT = """
import hashlib, json, sys
import torch
from torch import nn
import phalanx.train as pt

out, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


ctx = pt.init()
torch.manual_seed(0)
model = ctx.prepare_model(Net(), strategy="fsdp")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
start = 0
extra = ctx.load_sharded_checkpoint(model, optimizer)
if extra is not None:
    start = extra["step"] + 1
if mode == "inspect":  # what a resharded load holds, with no training
    steps = start
for step in range(start, steps):
    g = torch.Generator().manual_seed(step * 100 + ctx.rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    with ctx.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    ctx.backward(loss, optimizer)
    ctx.report({"loss": loss}, step=step)
    if mode == "save" and step == steps // 2:
        ctx.save_sharded_checkpoint(model, optimizer, extra={"step": step, "note": ["any", "picklable"]})
        break
state = ctx.full_model_state(model)
digest = hashlib.sha256()
for key in sorted(state):
    digest.update(state[key].to(torch.float32).numpy().tobytes())
local = model.blocks[0].weight.to_local().shape[0] if hasattr(model.blocks[0].weight, "to_local") else None
ctx.finish()
with open(f"{out}/rank{ctx.rank}.json", "w") as handle:
    json.dump({"digest": digest.hexdigest(), "local_rows": local, "keys": len(state), "extra": extra}, handle)
"""


def run(tmp_path: Path, mode: str, steps: int, ranks: int = 2, **env: str) -> list[dict[str, object]]:
    script = tmp_path / "fsdp.py"
    script.write_text(SCRIPT)
    for old in tmp_path.glob("rank*.json"):
        old.unlink()
    launcher = [*TORCHRUN] if ranks == 2 else [sys.executable]
    done = subprocess.run(
        [*launcher, str(script), str(tmp_path), mode, str(steps)],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]


def test_fsdp_shards_the_model_and_resumes_exactly_from_a_sharded_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    # bf16: FSDP's mixed precision (bf16 all-gathers, fp32 reduce-scatters) under the job's autocast
    env = {"PHALANX_CHECKPOINT_ROOT": f"file://{root}", "PHALANX_PRECISION": "bf16-mixed"}
    full = run(tmp_path, "full", 10, **env)
    assert [r["local_rows"] for r in full] == [8, 8], "each rank holds half of each weight"
    assert full[0]["keys"] == 8 and full[1]["keys"] == 0, "the full state is gathered on rank 0 only"

    run(tmp_path, "save", 10, **env)
    (saved,) = list(root.iterdir())
    assert saved.name == f"step-{5:012d}-a0"
    assert {p.name for p in saved.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}, "one file per rank"

    resume = {"PHALANX_RESUME_STEP": "5", "PHALANX_RESUME_PATH": f"file://{saved}", "PHALANX_ATTEMPT": "1"}
    resumed = run(tmp_path, "full", 10, **env, **resume)
    assert resumed[0]["extra"] == {"step": 5, "note": ["any", "picklable"]}
    assert resumed[0]["digest"] == full[0]["digest"], "the resumed run ends exactly where the whole one did"


def test_a_sharded_checkpoint_loads_at_another_world_size(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    saved_by_two = run(tmp_path, "save", 10, PHALANX_CHECKPOINT_ROOT=f"file://{root}")
    (saved,) = list(root.iterdir())
    resume = {"PHALANX_RESUME_STEP": "5", "PHALANX_RESUME_PATH": f"file://{saved}", "PHALANX_ATTEMPT": "1"}
    alone = run(tmp_path, "inspect", 0, ranks=1, PHALANX_CHECKPOINT_ROOT=f"file://{root}", **resume)
    assert alone[0]["local_rows"] == 16, "one rank holds the whole weight"
    assert alone[0]["digest"] == saved_by_two[0]["digest"], "the same parameters, resharded for one rank"


def test_prepare_model_names_what_is_wrong() -> None:
    ctx = pt.init()
    try:
        with pytest.raises(ValueError, match="'ddp' or 'fsdp'"):
            ctx.prepare_model(torch.nn.Linear(2, 2), strategy="zero3")
        with pytest.raises(ValueError, match="find_unused_parameters: DDP arguments"):
            ctx.prepare_model(torch.nn.Linear(2, 2), strategy="fsdp", find_unused_parameters=True)
    finally:
        ctx.finish()
