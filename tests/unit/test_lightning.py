"""phalanx.integrations.lightning with real Lightning, in one process and as 2 ranks under torchrun
(outside Phalanx: metrics kept in memory, checkpoints under PHALANX_CHECKPOINT_ROOT)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.unit.test_train_api import TORCHRUN, subprocess_env

REPO = Path(__file__).resolve().parents[2]

STOPPING = """
import json, os, signal, sys
import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import phalanx.integrations.lightning as pxl
import phalanx.train as pt


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # a stop asked of rank 1 only
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 8), torch.randint(0, 2, (4096,)))
trainer = L.Trainer(
    max_epochs=1, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, **pxl.trainer_kwargs()
)
trainer.fit(Model(), DataLoader(data, batch_size=8), ckpt_path=pxl.ckpt_path())
ctx = pt.init()
ctx.flush()
steps = sorted({m["step"] for m in ctx.metrics})
with open(sys.argv[1] + f"/rank{trainer.global_rank}.json", "w") as out:
    json.dump({"global_step": trainer.global_step, "metric_steps": steps}, out)
"""


def test_a_stop_asked_of_one_rank_ends_fit_on_both_after_a_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "stopping.py"
    script.write_text(STOPPING)
    root = tmp_path / "checkpoints"
    env = subprocess_env(PHALANX_CHECKPOINT_ROOT=f"file://{root}")
    done = subprocess.run([*TORCHRUN, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    stopped = ranks[0]["global_step"]
    assert ranks[1]["global_step"] == stopped, ranks  # the same step on both ranks
    assert 5 < stopped < 256, "stopped soon after the request, long before the epoch's 256 steps"
    assert ranks[0]["metric_steps"], "self.log values reached the context as metrics"
    (saved,) = [p.name for p in root.iterdir()]
    assert saved == f"step-{stopped:012d}-a0", "one checkpoint: the one written on the way out"
    state = __import__("torch").load(root / saved / "state.pt", weights_only=False)
    assert state["global_step"] == stopped and "optimizer_states" in state


def test_the_lightning_example_runs_without_phalanx(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    done = subprocess.run(
        [sys.executable, "train.py", "--epochs", "2"],
        cwd=REPO / "examples" / "lightning",
        env=subprocess_env(PHALANX_CHECKPOINT_ROOT=f"file://{root}"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(root.iterdir())) == 2, "Lightning's ModelCheckpoint saved each epoch through Phalanx"


def test_your_callbacks_and_plugins_join_phalanxs() -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    import phalanx.integrations.lightning as pxl
    import phalanx.train as pt

    mine, io = ModelCheckpoint(every_n_train_steps=5), TorchCheckpointIO()
    try:
        kwargs = pxl.trainer_kwargs(callbacks=[mine], plugins=[io])
        assert kwargs["callbacks"][0] is mine and isinstance(kwargs["callbacks"][1], pxl.PhalanxStopCallback)
        assert kwargs["plugins"][0] is io and isinstance(kwargs["plugins"][1], pxl.PhalanxCheckpointIO)
    finally:
        pt.init().finish()
