"""Lightning on Phalanx: three lines in a Lightning script.

    import phalanx.integrations.lightning as pxl

    trainer = L.Trainer(max_epochs=10, **pxl.trainer_kwargs())
    trainer.fit(model, datamodule, ckpt_path=pxl.ckpt_path())

What `trainer_kwargs()` gives the Trainer:

- the gang: `num_nodes`, `devices` (the ranks per node), `accelerator`, the DDP strategy and the
  job's `precision`. Phalanx's context sets up the process group; Lightning finds it set up.
- `logger`: every `self.log(...)` value reaches Phalanx as a job metric at the trainer's step.
- `plugins`: a `CheckpointIO` through which every checkpoint Lightning saves (its
  `ModelCheckpoint`, `trainer.save_checkpoint`) becomes a Phalanx checkpoint: written in the
  background, committed once, kept or deleted by the job's retention policy, resumed from after a
  restart (`ckpt_path()`).
- `callbacks`: a stop request (pause, drain, preemption, pruning) ends `fit` on every rank at the
  same step, after a checkpoint of that step.

Checkpoints: with `enable_checkpointing` left on, Lightning's own `ModelCheckpoint` decides when
to save (every epoch by default; `trainer_kwargs(callbacks=[ModelCheckpoint(every_n_train_steps=
...)])` changes it); the files it would rotate are Phalanx's to keep or delete.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.io import CheckpointIO

import phalanx.train as pt
from phalanx.train._checkpoint import STATE_FILE

# Phalanx's precision names and Lightning's
_PRECISION = {"32": "32-true", "bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed"}


class PhalanxLogger(Logger):
    """Lightning's logged values as Phalanx metrics (per rank, at the trainer's global step)."""

    def __init__(self, ctx: pt.Context) -> None:
        super().__init__()
        self._ctx = ctx

    @property
    def name(self) -> str:
        return "phalanx"

    @property
    def version(self) -> str:
        return str(self._ctx.job_id or 0)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        values = {k: v for k, v in metrics.items() if k != "epoch"}
        if values:
            self._ctx.report(values, step=step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The job's hyperparameters are in its job file already."""


class PhalanxCheckpointIO(CheckpointIO):
    """Every checkpoint Lightning saves becomes a Phalanx checkpoint of its global step.

    Lightning calls `save_checkpoint` on global rank 0 only (DDP): rank 0 writes the state dict
    (the training thread pays for the write only), the commit happens in the background."""

    def __init__(self, ctx: pt.Context) -> None:
        self._ctx = ctx
        self.trainer: Trainer | None = None  # set by PhalanxStopCallback.setup: metrics rank checkpoints

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        metrics = dict(self.trainer.callback_metrics) if self.trainer is not None else {}
        self._ctx.save_checkpoint(checkpoint, step=int(checkpoint.get("global_step", 0)), metrics=metrics)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        with fsspec.open(str(path), "rb") as handle:
            loaded: dict[str, Any] = torch.load(
                handle, map_location=map_location or "cpu", weights_only=bool(weights_only)
            )
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        """Retention is the job's `checkpoint:` policy; Phalanx deletes what it no longer keeps."""


class PhalanxStopCallback(Callback):
    """A stop request ends `fit` on every rank at the same step, after a checkpoint of that step."""

    def __init__(self, ctx: pt.Context, io: PhalanxCheckpointIO) -> None:
        self._ctx = ctx
        self._io = io

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._io.trainer = trainer

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning has just installed its SIGTERM handler, which would end `fit` with an exception
        # (after a broadcast from inside the handler) and no checkpoint.
        self._ctx.take_back_sigterm()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        if trainer.should_stop or not self._ctx.should_stop():
            return
        trainer.save_checkpoint(f"phalanx-stop-step-{trainer.global_step}.ckpt")
        trainer.should_stop = True


def trainer_kwargs(callbacks: list[Callback] | None = None, plugins: list[Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for `L.Trainer(...)`: spread them in, next to your own. Pass your own
    `callbacks` and `plugins` here rather than to the Trainer: they join Phalanx's."""
    ctx = pt.init()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    io = PhalanxCheckpointIO(ctx)
    kwargs: dict[str, Any] = {
        "num_nodes": max(1, ctx.world_size // local),
        "devices": local,
        "accelerator": "gpu" if ctx.device.type == "cuda" else "cpu",
        "precision": _PRECISION.get(ctx.precision, "32-true"),
        "logger": PhalanxLogger(ctx),
        "plugins": [*(plugins or []), io],
        "callbacks": [*(callbacks or []), PhalanxStopCallback(ctx, io)],
    }
    if ctx.world_size > 1:
        kwargs["strategy"] = "ddp"
    return kwargs


def ckpt_path() -> str | None:
    """The checkpoint to resume from (`trainer.fit(..., ckpt_path=ckpt_path())`); None at first."""
    latest = pt.init().latest_checkpoint
    return None if latest is None else f"{latest.path}/{STATE_FILE}"
