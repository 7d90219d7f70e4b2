"""Phalanx port of train_plain.py: the same MLP on scikit-learn's digits, as DDP across ranks."""

import argparse
import hashlib
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx.train as pt


def load_data() -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(digits.data / 16.0, digits.target, test_size=0.2, random_state=0)

    def as_dataset(x, y) -> TensorDataset:
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64))

    return as_dataset(x_train, y_train), as_dataset(x_val, y_val)


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def checksum(model: nn.Module) -> str:
    """sha256 of the parameters (float32, named_parameters order): equal runs print equal sums."""
    digest = hashlib.sha256()
    for _, param in model.named_parameters():
        digest.update(param.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def make_optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, ctx: pt.Context) -> tuple[float, bool]:
    """Validation accuracy, and whether any rank was asked to stop (pruned, paused, preempted):
    the flag rides on the same all_reduce, so every rank leaves after the same epoch."""
    model.eval()
    counts = torch.zeros(3, device=ctx.device)  # correct, total, stop requests
    for x, y in loader:
        counts[:2] += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)], device=ctx.device)
    counts[2] = float(ctx.should_stop())
    if ctx.world_size > 1:  # each rank saw its own shard of the validation set
        dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item(), bool(counts[2] > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--checkpoint-every", type=int, default=1, metavar="EPOCHS", help="checkpoint cadence")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    args = parser.parse_args()
    ctx = pt.init()
    # The job file's hyperparameters win; the flags still work for a plain `python train.py`.
    lr = float(ctx.hparams.get("lr", args.lr))
    hidden = int(ctx.hparams.get("hidden", args.hidden))
    batch_size = int(ctx.hparams.get("batch_size", args.batch_size))
    optimizer_name = str(ctx.hparams.get("optimizer", args.optimizer))
    print(f"rank {ctx.rank} of {ctx.world_size} on {ctx.device}: lr={lr} hidden={hidden}", flush=True)

    # A model this small runs fastest on one thread, and float sums then come out the same on
    # every machine (the result would otherwise depend on the core count).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train_set, val_set = load_data()
    model = ctx.prepare_model(build_model(hidden))
    train_loader = ctx.prepare_data_loader(
        DataLoader(train_set, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    )
    val_loader = ctx.prepare_data_loader(DataLoader(val_set, batch_size=256))
    optimizer = make_optimizer(optimizer_name, model, lr)
    loss_fn = nn.CrossEntropyLoss()

    start_epoch, global_step, train_seconds = 0, 0, 0.0
    if ctx.latest_checkpoint is not None:  # a restarted attempt: carry on after the last checkpoint
        state = ctx.latest_checkpoint.load()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, global_step = state["epoch"] + 1, state["step"]
        print(f"rank {ctx.rank} resumes after epoch {state['epoch']} (step {global_step})", flush=True)
    first_step = global_step + 1
    for epoch in range(start_epoch, args.epochs):
        train_loader.set_epoch(epoch)  # the shuffle of each epoch depends on the epoch alone
        loss_sum, seen = torch.zeros((), device=ctx.device), 0
        epoch_start = time.perf_counter()
        for x, y in train_loader:
            with ctx.autocast():
                logits = model(x)
                loss = loss_fn(logits, y)
            ctx.backward(loss, optimizer)  # zero_grad, backward, step (loss-scaled for fp16-mixed)
            loss_sum += loss.detach() * len(y)  # no .item() per step: it would sync every step
            seen += len(y)
            global_step += 1
            accuracy = (logits.argmax(1) == y).float().mean()
            ctx.report({"loss": loss, "accuracy": accuracy}, step=global_step)  # queued; never blocks
            if global_step == first_step:  # benchmarks: time to first step; the rate excludes this warm-up
                epoch_start = time.perf_counter()
                if ctx.rank == 0:
                    print(f"phalanx-first-step {time.time():.3f}", flush=True)
        train_seconds += time.perf_counter() - epoch_start
        accuracy, stop = evaluate(model, val_loader, ctx)
        if (epoch + 1) % args.checkpoint_every == 0 or epoch + 1 == args.epochs or stop:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
                "step": global_step,
            }
            # rank 0 writes; the rename and the commit to Phalanx happen off the training thread
            ctx.report({"val_accuracy": accuracy}, step=global_step, checkpoint=state)
        else:
            ctx.report({"val_accuracy": accuracy}, step=global_step)
        if ctx.rank == 0:
            print(f"epoch {epoch} loss {loss_sum.item() / seen:.4f} val_accuracy {accuracy:.4f}", flush=True)
        if stop:  # checkpointed above: a resumed attempt carries on from this epoch
            print(f"rank {ctx.rank} stops after epoch {epoch}: asked to stop", flush=True)
            break

    if ctx.rank == 0:
        print(f"final-checksum: {checksum(model)}")
        print(f"phalanx-steps-per-second {(global_step - first_step) / max(train_seconds, 1e-9):.1f}", flush=True)
    ctx.finish()


if __name__ == "__main__":
    main()
