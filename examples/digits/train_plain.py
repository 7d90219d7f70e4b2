"""Plain PyTorch: an MLP on scikit-learn's bundled digits (no download). train.py is its Phalanx port."""

import argparse
import hashlib

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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
def evaluate(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    counts = torch.zeros(2)  # correct, total
    for x, y in loader:
        counts += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
    model.train()
    return (counts[0] / counts[1]).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    args = parser.parse_args()
    lr, hidden, batch_size = args.lr, args.hidden, args.batch_size

    # A model this small runs fastest on one thread, and float sums then come out the same on
    # every machine (the result would otherwise depend on the core count).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train_set, val_set = load_data()
    model = build_model(hidden)
    train_loader = DataLoader(
        train_set, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    val_loader = DataLoader(val_set, batch_size=256)
    optimizer = make_optimizer(args.optimizer, model, lr)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        loss_sum, seen = torch.zeros(()), 0
        for x, y in train_loader:
            logits = model(x)
            loss = loss_fn(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * len(y)  # no .item() per step: it would sync every step
            seen += len(y)
        accuracy = evaluate(model, val_loader)
        print(f"epoch {epoch} loss {loss_sum.item() / seen:.4f} val_accuracy {accuracy:.4f}", flush=True)

    print(f"final-checksum: {checksum(model)}")


if __name__ == "__main__":
    main()
