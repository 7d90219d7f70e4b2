"""phalanx.integrations.transformers with the real Trainer, as 2 ranks under torchrun (outside
Phalanx: metrics kept in memory, checkpoints under PHALANX_CHECKPOINT_ROOT, a resume point given
the way the agent gives it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.integrations.transformers import _own_files
from tests.unit.test_train_api import TORCHRUN, subprocess_env

REPO = Path(__file__).resolve().parents[2]

STOPPING = """
import json, os, signal, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback
import phalanx.integrations.transformers as pxt
import phalanx.train as pt


class StopRankOne(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if args.process_index == 1 and state.global_step == 5 and os.environ.get("ASK_STOP"):
            os.kill(os.getpid(), signal.SIGTERM)  # a stop asked of rank 1 only


class Windows(torch.utils.data.Dataset):
    def __len__(self):
        return 2048

    def __getitem__(self, i):
        ids = torch.arange(i, i + 16) % 11
        return {"input_ids": ids, "labels": ids}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=11, n_positions=16, n_embd=16, n_layer=1, n_head=2))
args = pxt.training_args(
    output_dir=sys.argv[1] + "/out", per_device_train_batch_size=8, max_steps=int(sys.argv[2]), logging_steps=1,
    save_strategy="no", learning_rate=1e-3, dataloader_pin_memory=False, ddp_find_unused_parameters=False,
)
trainer = Trainer(model=model, args=args, train_dataset=Windows(), callbacks=[StopRankOne(), pxt.callback()])
trainer.train(resume_from_checkpoint=pxt.resume_path())
ctx = pt.init()
ctx.flush()
steps = sorted({m["step"] for m in ctx.metrics if "loss" in m["values"]})
with open(sys.argv[1] + f"/rank{args.process_index}.json", "w") as out:
    json.dump({"global_step": trainer.state.global_step, "loss_steps": steps, "lr": args.learning_rate}, out)
"""


def run_ranks(tmp_path: Path, max_steps: int, **env: str) -> list[dict[str, object]]:
    script = tmp_path / "stopping.py"
    script.write_text(STOPPING)
    done = subprocess.run(
        [*TORCHRUN, str(script), str(tmp_path), str(max_steps)],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_stop_asked_of_one_rank_ends_training_on_both_after_a_checkpoint_then_resumes(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    ranks = run_ranks(
        tmp_path,
        100,
        PHALANX_CHECKPOINT_ROOT=f"file://{root}",
        PHALANX_HPARAMS=json.dumps({"learning_rate": 0.01, "hidden": 3}),
        ASK_STOP="1",
    )
    stopped = ranks[0]["global_step"]
    assert ranks[1]["global_step"] == stopped, ranks  # the same step on both ranks
    assert isinstance(stopped, int) and 5 < stopped < 100, "stopped soon after the request"
    assert ranks[0]["loss_steps"] == list(range(1, stopped + 1)), "every logged loss became a metric at its step"
    assert ranks[0]["lr"] == 0.01, "a job hyperparameter that names a TrainingArguments field wins"

    (saved,) = list(root.iterdir())  # with save_strategy "no", the one written on the way out
    assert saved.name == f"step-{stopped:012d}-a0"
    files = {p.name for p in saved.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= files
    assert json.loads((saved / "trainer_state.json").read_text())["global_step"] == stopped

    resumed = run_ranks(
        tmp_path,
        stopped + 4,
        PHALANX_CHECKPOINT_ROOT=f"file://{root}",
        PHALANX_RESUME_STEP=str(stopped),
        PHALANX_RESUME_PATH=f"file://{saved}",
        PHALANX_ATTEMPT="1",
    )
    assert resumed[0]["global_step"] == stopped + 4
    assert resumed[0]["loss_steps"] == list(range(stopped + 1, stopped + 5)), "the Trainer went on from the checkpoint"


def test_each_rank_contributes_the_files_it_wrote(tmp_path: Path) -> None:
    for name in ("model.safetensors", "rng_state_0.pth", "rng_state_1.pth", "rng_state_12.pth", "sub/part.bin"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert _own_files(tmp_path, 0) == ["model.safetensors", "rng_state_0.pth", "sub/part.bin"]
    assert _own_files(tmp_path, 1) == ["rng_state_1.pth"]
    assert _own_files(tmp_path, 12) == ["rng_state_12.pth"]
    assert _own_files(tmp_path, 3) == []


@pytest.mark.parametrize(("precision", "flag"), [("bf16-mixed", "bf16"), ("32", None)])
def test_training_args_carry_the_jobs_precision(tmp_path: Path, precision: str, flag: str | None) -> None:
    code = (
        "import phalanx.integrations.transformers as pxt; a = pxt.training_args(output_dir='o');"
        "print(a.bf16, a.fp16, a.use_cpu, a.report_to)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(PHALANX_PRECISION=precision),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(flag == "bf16"), "False", "True", "[]"]


def test_the_transformers_example_runs_without_phalanx(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    example = shutil.copytree(REPO / "examples" / "hf_trainer", tmp_path / "example")  # it writes out/ beside it
    done = subprocess.run(
        [sys.executable, "train.py", "--epochs", "1"],
        cwd=example,
        env=subprocess_env(PHALANX_CHECKPOINT_ROOT=f"file://{root}", HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in root.iterdir()) == ["step-000000000040-a0", "step-000000000052-a0"]
