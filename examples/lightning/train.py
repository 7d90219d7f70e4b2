"""Phalanx port of train_plain.py: the same Lightning module, as DDP across the job's ranks."""

import argparse

import lightning.pytorch as L
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx.integrations.lightning as pxl


class Digits(L.LightningModule):
    def __init__(self, hidden: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_accuracy", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)


def loaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    digits = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(digits.data / 16.0, digits.target, test_size=0.2, random_state=0)

    def dataset(x, y) -> TensorDataset:
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64))

    return DataLoader(dataset(x_train, y_train), batch_size=batch_size, shuffle=True), DataLoader(
        dataset(x_val, y_val), batch_size=256
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    train, val = loaders(batch_size=32)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        **pxl.trainer_kwargs(),
    )
    trainer.fit(Digits(args.hidden, args.lr), train, val, ckpt_path=pxl.ckpt_path())


if __name__ == "__main__":
    main()
