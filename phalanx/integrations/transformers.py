"""Hugging Face Transformers on Phalanx: three lines in a `Trainer` script.

    import phalanx.integrations.transformers as pxt

    args = pxt.training_args(output_dir="out", num_train_epochs=3, learning_rate=5e-4)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[pxt.callback()])
    trainer.train(resume_from_checkpoint=pxt.resume_path())

- `training_args(**defaults)`: `TrainingArguments` from your defaults, the job's `precision`
  (bf16/fp16) and every hyperparameter of the job (`ctx.hparams`, a study's trial included) that
  names a `TrainingArguments` field: a study tunes `learning_rate` or `warmup_steps` with no code.
- `callback()`: every logged value (`loss`, `learning_rate`, `grad_norm`, eval metrics) becomes a
  job metric at the trainer's global step; every checkpoint the Trainer saves becomes a Phalanx
  checkpoint (each rank contributes the files it wrote, `rng_state_N.pth` included, and they are
  committed once as one folder); a stop request (pause, drain, preemption, pruning) saves a
  checkpoint of the current step and ends `train()` on every rank at that step.
- `resume_path()`: the folder of the checkpoint to resume from, or None at first. The Trainer
  restores the model, optimizer, scheduler, RNG states and its own step from it.

Phalanx's context sets up the process group before the Trainer exists; the Trainer (through
Accelerate) finds it set up and uses it.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path
from typing import Any

import fsspec
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import phalanx.train as pt

# The Trainer writes each rank's RNG state as its own file; every other file is the main process's.
_RNG_FILE = re.compile(r"rng_state_(\d+)\.pth")


class PhalanxCallback(TrainerCallback):
    """Trainer events into Phalanx: logs → metrics, saves → checkpoints, stop requests → stop."""

    def __init__(self, ctx: pt.Context) -> None:
        self._ctx = ctx
        self._last_logs: dict[str, float] = {}

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Transformers' own JIT-checkpoint handler (if enabled) would race ours for the same signal.
        self._ctx.take_back_sigterm()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        values = {key: value for key, value in (logs or {}).items() if isinstance(value, (int, float))}
        if values:
            self._last_logs.update(values)
            self._ctx.report(values, step=state.global_step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self._ctx.should_stop():  # every rank, every step: they all agree at the same step
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        folder = Path(args.output_dir or ".") / f"checkpoint-{state.global_step}"
        self._ctx.save_checkpoint(
            folder, step=state.global_step, metrics=self._last_logs, files=_own_files(folder, args.process_index)
        )


def _own_files(folder: Path, process_index: int) -> list[str]:
    """The files of `folder` this process wrote: its RNG state, and for process 0 everything else."""
    own = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        rng = _RNG_FILE.fullmatch(name)
        if (int(rng.group(1)) == process_index) if rng else process_index == 0:
            own.append(name)
    return own


def callback() -> PhalanxCallback:
    """The `TrainerCallback` for `Trainer(..., callbacks=[callback()])`."""
    return PhalanxCallback(pt.init())


def training_args(**defaults: Any) -> TrainingArguments:
    """`TrainingArguments(**defaults)`, with the job's precision and the job's hyperparameters that
    name `TrainingArguments` fields on top (the job file and a study's trial win over the script)."""
    ctx = pt.init()
    fields = {field.name for field in dataclasses.fields(TrainingArguments) if field.init}
    kwargs: dict[str, Any] = {"report_to": "none", "disable_tqdm": True, **defaults}
    if ctx.device.type == "cpu":
        # Accelerate runs several processes on CPU only when told so; otherwise each rank trains alone.
        kwargs["use_cpu"] = True
    if ctx.precision == "bf16-mixed":
        kwargs["bf16"] = True
    elif ctx.precision == "fp16-mixed":
        kwargs["fp16"] = True
    kwargs.update({key: value for key, value in ctx.hparams.items() if key in fields})
    return TrainingArguments(**kwargs)


def resume_path() -> str | None:
    """The checkpoint folder for `trainer.train(resume_from_checkpoint=...)`; None at first.

    The Trainer reads a local folder: a checkpoint on a shared filesystem is used where it is, one
    on an object store is copied to a temporary folder first."""
    latest = pt.init().latest_checkpoint
    if latest is None:
        return None
    local = latest.local_path
    if local is not None:
        return str(local)
    fs, root = fsspec.core.url_to_fs(latest.path)
    target = Path(tempfile.mkdtemp(prefix="phalanx-resume-"))
    root = root.rstrip("/")
    for remote in fs.find(root):
        destination = target / remote[len(root) + 1 :]
        destination.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(destination))
    return str(target)
