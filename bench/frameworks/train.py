"""A framework's own training loop, with or without Phalanx's integration, timed the same way.

    python train.py lightning|transformers [--phalanx] [--steps N]

Without `--phalanx` it imports nothing of Phalanx: what a user of the framework runs under plain
torchrun. Rank 0 prints `phalanx-steps-per-second <rate>`: optimizer steps per second from the
WARMUP-th step to the last, taken by a callback of the framework's own on both sides.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

WARMUP = 20


class Rate:
    """Steps per second between the WARMUP-th step and the last one."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.steps = 0

    def step(self, global_step: int) -> None:
        if global_step == WARMUP:
            self.started = time.perf_counter()
        self.steps = global_step

    def report(self) -> None:
        if int(os.environ.get("RANK", "0")) == 0 and self.started is not None:
            print(f"phalanx-steps-per-second {(self.steps - WARMUP) / (time.perf_counter() - self.started):.2f}")


def lightning(steps: int, phalanx: bool) -> None:
    import lightning.pytorch as L
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    rate = Rate()

    class Digits(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def on_train_batch_end(self, *args: Any) -> None:
            rate.step(self.global_step)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target))
    loader = DataLoader(data, batch_size=32, shuffle=True)
    common = {"max_steps": steps, "log_every_n_steps": 10, "enable_progress_bar": False, "enable_model_summary": False}
    # An epoch here lasts ~0.25 s: Lightning's default checkpoint per epoch would be 4 a second on
    # both sides. Every 100 steps (~1 s) is bench_ddp_throughput's cadence, still far above real use.
    callbacks = [L.callbacks.ModelCheckpoint(every_n_train_steps=100)]
    if phalanx:
        import phalanx.integrations.lightning as pxl

        trainer = L.Trainer(**common, **pxl.trainer_kwargs(callbacks=callbacks))
        trainer.fit(Digits(), loader, ckpt_path=pxl.ckpt_path())
    else:
        world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gang = {"num_nodes": world // local, "devices": local, "accelerator": "cpu", "strategy": "ddp"}
        trainer = L.Trainer(**common, callbacks=callbacks, **(gang if world > 1 else {}))
        trainer.fit(Digits(), loader)
    rate.report()


def transformers(steps: int, phalanx: bool) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    rate = Rate()

    class Timing(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rate.step(state.global_step)

    class Windows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 100_000

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.arange(i, i + 32) % 50
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    common = {
        "output_dir": "out",
        "max_steps": steps,
        "per_device_train_batch_size": 16,
        "logging_steps": 10,
        "save_steps": 100,
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_pin_memory": False,
        "ddp_find_unused_parameters": False,
    }
    callbacks: list[TrainerCallback] = [Timing()]
    resume = None
    if phalanx:
        import phalanx.integrations.transformers as pxt

        args = pxt.training_args(**common)
        callbacks.append(pxt.callback())
        resume = pxt.resume_path()
    else:
        args = TrainingArguments(**common, use_cpu=not torch.cuda.is_available())
    Trainer(model=model, args=args, train_dataset=Windows(), callbacks=callbacks).train(resume_from_checkpoint=resume)
    rate.report()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("framework", choices=("lightning", "transformers"))
    parser.add_argument("--phalanx", action="store_true", help="through Phalanx's integration")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    (lightning if args.framework == "lightning" else transformers)(args.steps, args.phalanx)


if __name__ == "__main__":
    main()
