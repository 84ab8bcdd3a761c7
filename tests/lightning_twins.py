"""The same tiny module and run under PyTorch Lightning and here, for callbacks compared side by side: one
class body on either base class, the same seeded weights and data, SGD (so every factor on a gradient shows
in the weights), and each framework's Trainer with the same quiet flags."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from helpers import regression_data
from torch import nn
from torch.utils.data import DataLoader

from trainer import Trainer, TrainModule


def twin(base: type) -> type:
    """A two-layer regressor on `base` (LightningModule or TrainModule); `fail_at`: training_step raises at
    that global step; `losses`: the loss of each batch index is this number times the real one (spikes)."""

    class Net(base):
        def __init__(self, fail_at: int | None = None, losses: dict[int, float] | None = None) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 16)
            self.head = nn.Linear(16, 1)
            self.fail_at, self.losses = fail_at, losses or {}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.layer(x)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == self.fail_at:
                raise RuntimeError(f"failing at step {self.global_step}")
            x, y = batch
            return nn.functional.mse_loss(self(x), y) * self.losses.get(batch_idx, 1.0)

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    Net.__name__ = Net.__qualname__ = "Net"
    return Net


LitNet, OurNet = twin(pl.LightningModule), twin(TrainModule)


def nets(**kwargs: Any) -> tuple[pl.LightningModule, TrainModule]:
    """Lightning's and our module with the same initial weights."""
    torch.manual_seed(0)
    lit = LitNet(**kwargs)
    ours = OurNet(**kwargs)
    ours.load_state_dict(lit.state_dict())
    return lit, ours


def loader(n: int = 64, batch_size: int = 8) -> DataLoader:
    return DataLoader(regression_data(n), batch_size=batch_size)


QUIET = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False}
# what a Lightning user's test run passes: no logger, checkpoint, bar or summary, one CPU process
QUIET_RUN = {**QUIET, "enable_progress_bar": False, "enable_model_summary": False}
FRAMEWORKS = ("lightning", "trainer")


def trainers(
    root: Path, lit_callbacks: list, our_callbacks: list, **flags: Any
) -> tuple[pl.Trainer, Trainer]:
    """Lightning's Trainer and ours with the same flags (no logger, checkpoint, bar or summary unless given)."""
    flags = {"enable_progress_bar": False, "enable_model_summary": False, **QUIET, **flags}
    lit = pl.Trainer(default_root_dir=root / "lightning", callbacks=lit_callbacks, **flags)
    ours = Trainer(default_root_dir=root / "ours", callbacks=our_callbacks, seed=None, **flags)
    return lit, ours


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_weights(lit: nn.Module, ours: nn.Module, atol: float = 1e-6) -> None:
    theirs, mine = weights(lit), weights(ours)
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        diff = (mine[name] - value).abs().max().item()
        assert diff <= atol, f"{name} differs by {diff:.2e}"


@contextlib.contextmanager
def logged(name: str) -> Iterator[list[str]]:
    """The messages of logger `name` while inside (a handler of its own: neither Lightning's logger nor ours
    propagates to pytest's)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
