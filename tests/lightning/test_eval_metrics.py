"""`trainer.validate(...)` and `trainer.test(...)` outside a fit fill `trainer.callback_metrics` and
`trainer.logged_metrics` as PyTorch Lightning's do: the epoch-level values (`name`, and `name_epoch` beside
`name_step` for what is logged on both), each stage's own (what an earlier fit or stage left is gone)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer import Trainer, TrainModule

QUIET_FLAGS = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


def eval_data() -> TensorDataset:
    """24 examples: three batches of 8 (the epoch means need no batch size, which Lightning infers)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 4, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def logging_module(base: type) -> type:
    """A regressor whose validation and test steps log on the step, on the epoch and on both."""

    class Logs(base):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def _eval(self, stage: str, batch) -> None:
            loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log(f"{stage}_loss", loss)  # Lightning's default here: on the epoch
            self.log(f"{stage}_both", loss * 2, on_step=True, on_epoch=True)
            self.log(f"{stage}_step_only", loss * 3, on_step=True, on_epoch=False)
            self.log(f"{stage}_hidden", loss * 4, logger=False)
            self.log(f"{stage}_max", loss, reduce_fx="max")

        def validation_step(self, batch, batch_idx):
            self._eval("val", batch)

        def test_step(self, batch, batch_idx):
            self._eval("test", batch)

        def on_validation_epoch_end(self):
            self.log("val_epoch_end", 7.0)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Logs


LitLogs, OurLogs = logging_module(pl.LightningModule), logging_module(TrainModule)


def plain(metrics: dict) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items()}


def run(framework: str, tmp_path, stages: tuple[str, ...], fit_first: bool) -> list[tuple[dict, dict]]:
    """(callback_metrics, logged_metrics) after each of `stages` ("validate", "test"), on one Trainer."""
    flags = dict(QUIET_FLAGS, default_root_dir=tmp_path / framework, max_epochs=1)
    if framework == "lightning":
        trainer, model = pl.Trainer(accelerator="cpu", devices=1, **flags), LitLogs()
    else:
        trainer, model = Trainer(**flags), OurLogs()
    if fit_first:
        trainer.fit(model, DataLoader(eval_data(), batch_size=8))
    seen = []
    for stage in stages:
        getattr(trainer, stage)(model, DataLoader(eval_data(), batch_size=8))
        seen.append((plain(trainer.callback_metrics), plain(trainer.logged_metrics)))
    return seen


@pytest.mark.parametrize("fit_first", [False, True], ids=["alone", "after_fit"])
def test_validate_then_test_fill_callback_and_logged_metrics_as_lightning(tmp_path, fit_first):
    theirs = run("lightning", tmp_path, ("validate", "test"), fit_first)
    ours = run("ours", tmp_path, ("validate", "test"), fit_first)
    assert [sorted(c) for c, _ in ours] == [sorted(c) for c, _ in theirs]
    assert [sorted(lg) for _, lg in ours] == [sorted(lg) for _, lg in theirs]
    for (our_cb, our_logged), (lit_cb, lit_logged) in zip(ours, theirs, strict=True):
        assert our_cb == pytest.approx(lit_cb, rel=1e-6)
        assert our_logged == pytest.approx(lit_logged, rel=1e-6)
