"""Shared test helpers: tiny modules and data built in a few lines."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer import TrainModule

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


class Regression(TrainModule):
    """A small MLP on a regression task; `dropout` makes the run depend on the RNG."""

    def __init__(self, dropout: float = 0.0, lr: float = 1e-2, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(32, 1)
        )
        self.lr, self.optimizer_name = lr, optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def regression_data(n: int = 256, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g))


def regression_loader(batch_size: int = 16, shuffle: bool = False, n: int = 256) -> DataLoader:
    return DataLoader(regression_data(n), batch_size=batch_size, shuffle=shuffle)


def read_metrics(root: Path, key: str = "train/loss") -> dict[int, float]:
    """step -> value of `key` from the always-on JSONL log."""
    out = {}
    for line in (Path(root) / "logs" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if key in row:
            out[row["step"]] = row[key]
    return out


def quiet(**overrides):
    """Trainer kwargs for tests: no progress bar, log every step."""
    return {"enable_progress_bar": False, "log_every_n_steps": 1, **overrides}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "run"
