"""The job's `ddp` options and compression hooks through `ctx.prepare_model`, the always-on
communication figures, and PowerSGD's state resuming exactly: 2 ranks under torchrun on gloo
(outside Phalanx: PHALANX_DDP set as the agent sets it, checkpoints under PHALANX_CHECKPOINT_ROOT)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from phalanx.schemas import DdpOptions, JobSpec, StudySpec
from phalanx.train._env import read_env
from server.studies import trial_job_spec
from tests.unit.test_train_api import TORCHRUN, subprocess_env

SCRIPT = """
import hashlib, json, sys
import torch
from torch import nn
import phalanx.train as pt
import phalanx.train._comm as comm

out, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
comm.REPORT_PERIOD_S = 0.5  # a few reports in a short run
ctx = pt.init()
figures = []
ctx._report_reserved = figures.append  # what would go to the server with the metric batches
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
model = ctx.prepare_model(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
start = 0
saved = ctx.load_checkpoint()
if saved is not None:
    model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    start = saved["step"] + 1
for step in range(start, steps):
    g = torch.Generator().manual_seed(step * 100 + ctx.rank)
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 8, (64,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if mode == "save" and step == steps // 2:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        ctx.save_checkpoint(state, step=step)
        break
digest = hashlib.sha256()
for key, value in sorted(model.module.state_dict().items()):
    digest.update(value.numpy().tobytes())
ctx.finish()
ddp = {"bucket_bytes_cap": model.bucket_bytes_cap, "gradient_as_bucket_view": model.gradient_as_bucket_view,
       "static_graph": model.static_graph}
params = sum(p.numel() for p in net.parameters())
with open(f"{out}/rank{ctx.rank}.json", "w") as handle:
    json.dump({"digest": digest.hexdigest(), "figures": figures, "params": params, "ddp": ddp}, handle)
"""


def run(tmp_path: Path, mode: str, steps: int, ddp: dict[str, Any], **env: str) -> list[dict[str, Any]]:
    script = tmp_path / "comm.py"
    script.write_text(SCRIPT)
    for old in tmp_path.glob("rank*.json"):
        old.unlink()
    done = subprocess.run(
        [*TORCHRUN, str(script), str(tmp_path), mode, str(steps)],
        env=subprocess_env(PHALANX_DDP=json.dumps(ddp), **env),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_jobs_ddp_options_reach_ddp(tmp_path: Path) -> None:
    ranks = run(tmp_path, "full", 3, {"bucket_cap_mb": 1, "gradient_as_bucket_view": True, "static_graph": True})
    assert ranks[0]["ddp"] == {"bucket_bytes_cap": 2**20, "gradient_as_bucket_view": True, "static_graph": True}


@pytest.mark.parametrize(
    ("hook", "bytes_per_param"),
    [("none", 4.0), ("fp16", 2.0), ("bf16", 2.0)],
)
def test_every_rank_reports_where_its_step_time_goes(tmp_path: Path, hook: str, bytes_per_param: float) -> None:
    ranks = run(tmp_path, "full", 400, {"comm_hook": hook})
    for rank in ranks:
        assert rank["figures"], "a report every REPORT_PERIOD_S"
        last = rank["figures"][-1]
        expected = bytes_per_param * rank["params"]
        assert abs(last["phalanx/comm_bytes_per_step"] - expected) <= 0.1 * expected
        assert 0 < last["phalanx/comm_exposed_s"] <= last["phalanx/comm_time_s"]
        assert 0 < last["phalanx/compute_time_s"] < last["phalanx/step_time_s"]
        assert last["phalanx/data_time_s"] == 0  # no prepared loader: nothing was waited for


def test_powersgd_sends_its_factors_and_resumes_exactly(tmp_path: Path) -> None:
    ddp = {"comm_hook": "powersgd", "powersgd_rank": 2, "powersgd_start_iter": 2}
    root = tmp_path / "checkpoints"
    env = {"PHALANX_CHECKPOINT_ROOT": f"file://{root}"}
    whole = run(tmp_path, "full", 400, ddp, **env)
    last = whole[0]["figures"][-1]
    # rank-2 factors of the two 256x256 weights and the 8x256 one, floats; the biases go whole
    # (a rank-1 factor pair of a vector is no smaller than the vector)
    factors = ((256 + 256) * 2 * 2 + (8 + 256) * 2 + (256 + 256 + 8)) * 4
    assert abs(last["phalanx/comm_bytes_per_step"] - factors) <= 0.1 * factors
    assert last["phalanx/comm_bytes_per_step"] < 0.1 * 4 * whole[0]["params"]

    run(tmp_path, "save", 20, ddp, **env)
    (saved,) = list(root.iterdir())
    assert {p.name for p in (saved / "phalanx-rank-state").iterdir()} == {"rank-0.pt", "rank-1.pt"}
    resume = {"PHALANX_RESUME_STEP": "10", "PHALANX_RESUME_PATH": f"file://{saved}", "PHALANX_ATTEMPT": "1"}
    uninterrupted = run(tmp_path, "full", 20, ddp, **env)
    resumed = run(tmp_path, "full", 20, ddp, **env, **resume)
    assert resumed[0]["digest"] == uninterrupted[0]["digest"], "the error feedback came back with the checkpoint"

    shutil.rmtree(saved / "phalanx-rank-state")
    forgetful = run(tmp_path, "full", 20, ddp, **env, **resume)
    assert forgetful[0]["digest"] != uninterrupted[0]["digest"], "without its state PowerSGD would drift"


def test_ddp_options_are_read_and_checked_from_the_environment() -> None:
    assert read_env({}).ddp["comm_hook"] == "none"
    env = read_env({"PHALANX_DDP": DdpOptions(comm_hook="powersgd", powersgd_rank=4).model_dump_json()})
    assert env.ddp["comm_hook"] == "powersgd" and env.ddp["powersgd_rank"] == 4
    for raw, message in [
        ('{"comm_hook": "zip"}', "comm_hook='zip' is not one of"),
        ('{"buckets": 3}', "unknown option(s) buckets"),
        ('{"powersgd_rank": 0}', "powersgd_rank=0 must be a positive integer"),
        ("[1]", "must be a JSON object"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read_env({"PHALANX_DDP": raw})


def test_a_job_file_names_its_ddp_options_and_nothing_else() -> None:
    base = {"name": "j", "entrypoint": "python train.py"}
    assert JobSpec.model_validate(base).ddp == DdpOptions()
    spec = JobSpec.model_validate({**base, "ddp": {"comm_hook": "bf16", "bucket_cap_mb": 50}})
    assert spec.ddp.comm_hook == "bf16" and spec.ddp.bucket_cap_mb == 50
    for bad in [{"comm_hook": "int8"}, {"bucket_cap_mb": 0}, {"powersgd_rank": 0}, {"buckets": 2}]:
        with pytest.raises(ValidationError):
            JobSpec.model_validate({**base, "ddp": bad})


def study(search_space: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "s",
        "objective": {"metric": "loss", "direction": "minimize"},
        "search_space": search_space,
        "n_trials": 2,
        "trial": {"entrypoint": "python train.py", "hyperparameters": {"lr": 0.1}},
    }


def test_a_study_searches_ddp_options_like_hyperparameters() -> None:
    spec = StudySpec.model_validate(
        study(
            {
                "ddp.comm_hook": {"type": "categorical", "choices": ["none", "bf16"]},
                "lr": {"type": "float", "low": 0.01, "high": 0.1},
            }
        )
    )
    trial = trial_job_spec(spec, 3, {"ddp.comm_hook": "bf16", "lr": 0.05})
    assert trial.ddp.comm_hook == "bf16"
    assert trial.hyperparameters == {"lr": 0.05}, "ddp options are not hyperparameters"

    with pytest.raises(ValidationError, match="ddp has no option 'buckets'"):
        StudySpec.model_validate(study({"ddp.buckets": {"type": "int", "low": 1, "high": 4}}))
    with pytest.raises(ValidationError, match=r"'zip' is not a valid ddp\.comm_hook"):
        StudySpec.model_validate(study({"ddp.comm_hook": {"type": "categorical", "choices": ["none", "zip"]}}))
