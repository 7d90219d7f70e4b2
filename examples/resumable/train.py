"""Phalanx port of train_plain.py: multi-node DDP with metrics, checkpoints, exact resume and clean
stops, in ten changed lines (`diff train_plain.py train.py`)."""

import argparse
import hashlib

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx.train as pt


def checksum(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = pt.init()
    torch.manual_seed(0)
    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target))
    loader = ctx.prepare_data_loader(DataLoader(data, batch_size=32, shuffle=True))
    model = ctx.prepare_model(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    state = ctx.load_checkpoint()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    for epoch in range(start, args.epochs):
        torch.manual_seed(epoch)  # the epoch's shuffle depends on the epoch alone: resumes are exact
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx.report({"loss": loss})
        print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
        ctx.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch})
        if ctx.should_stop():
            break
    print(f"final-checksum: {checksum(model)}")


if __name__ == "__main__":
    main()
