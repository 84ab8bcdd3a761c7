"""When a module's epoch-interval LR scheduler steps, against PyTorch Lightning 2.6: a scheduler without a
monitor steps in the epoch's last batch, after its optimizer step and before its `on_train_batch_end` (so that
hook, the epoch-end validation and `on_train_epoch_end` read the next epoch's rate); ReduceLROnPlateau steps
after `on_train_epoch_end`, on the metric of the validation just run. The LR each hook reads, from a callback
and from the module, is the same under both Trainers."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from helpers import StopAt
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback
from trainer import Trainer, TrainModule

HOOKS = ("on_train_batch_end", "on_validation_epoch_start", "on_validation_epoch_end", "on_train_epoch_end")


def lr_of(trainer) -> float:
    return trainer.optimizers[0].param_groups[0]["lr"]


class Body:
    """Records (who, hook, epoch, batch index or None, lr) for every hook of HOOKS, the module's side; logs a
    val metric that grows each epoch (ReduceLROnPlateau never sees it improve after the first)."""

    def __init__(self, scheduler: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.scheduler, self.seen = scheduler, []

    def training_step(self, batch, batch_idx):
        self.seen.append(("module", "training_step", self.current_epoch, batch_idx, lr_of(self.trainer)))
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_metric", float(self.current_epoch + 1))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        if self.scheduler == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_metric"}}
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(("module", "on_train_batch_end", self.current_epoch, batch_idx, lr_of(self.trainer)))

    def on_validation_epoch_start(self):
        self.seen.append(
            ("module", "on_validation_epoch_start", self.current_epoch, None, lr_of(self.trainer))
        )

    def on_validation_epoch_end(self):
        self.seen.append(("module", "on_validation_epoch_end", self.current_epoch, None, lr_of(self.trainer)))

    def on_train_epoch_end(self):
        self.seen.append(("module", "on_train_epoch_end", self.current_epoch, None, lr_of(self.trainer)))


class LitBody(Body, pl.LightningModule):
    pass


class OurBody(Body, TrainModule):
    pass


def recorder(base: type) -> Callback:
    """A callback that appends what its hooks read to the module's record."""

    class Recorder(base):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            module.seen.append(
                ("callback", "on_train_batch_end", trainer.current_epoch, batch_idx, lr_of(trainer))
            )

        def on_validation_epoch_start(self, trainer, module):
            module.seen.append(
                ("callback", "on_validation_epoch_start", trainer.current_epoch, None, lr_of(trainer))
            )

        def on_validation_epoch_end(self, trainer, module):
            module.seen.append(
                ("callback", "on_validation_epoch_end", trainer.current_epoch, None, lr_of(trainer))
            )

        def on_train_epoch_end(self, trainer, module):
            module.seen.append(
                ("callback", "on_train_epoch_end", trainer.current_epoch, None, lr_of(trainer))
            )

    return Recorder()


def data(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


@pytest.mark.parametrize("scheduler", ["step_lr", "plateau"])
def test_epoch_scheduler_steps_where_lightnings_does(tmp_path, scheduler):
    """3 epochs of 4 batches, each ending with a validation: every hook reads the same LR under both."""
    flags = dict(
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    lit = LitBody(scheduler)
    pl.Trainer(accelerator="cpu", devices=1, callbacks=[recorder(pl.Callback)], **flags).fit(
        lit, data(16), data(8)
    )
    ours = OurBody(scheduler)
    Trainer(callbacks=[recorder(Callback)], **flags).fit(ours, data(16), data(8))
    assert ours.seen == lit.seen
    rates = {lr for _, hook, epoch, batch_idx, lr in lit.seen if hook == "training_step" and epoch == 2}
    assert rates == ({0.25} if scheduler == "step_lr" else {0.5})  # it stepped twice / once before epoch 2


@pytest.mark.parametrize("stop", [3, 4, 5], ids=["before_last_batch", "at_last_batch", "after_epoch"])
def test_epoch_scheduler_resumed_from_any_step_steps_once_per_epoch(tmp_path, stop):
    """Stopped (with a checkpoint) around the end of epoch 0 and resumed: the rates of every later step are an
    uninterrupted run's (a checkpoint of the epoch's last batch holds the scheduler that already stepped)."""
    flags = dict(max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False)

    def run(root, callbacks=(), ckpt_path=None) -> OurBody:
        module = OurBody("step_lr")
        Trainer(default_root_dir=root, callbacks=list(callbacks), **flags).fit(
            module, data(16), ckpt_path=ckpt_path
        )
        return module

    whole = run(tmp_path / "whole")
    run(tmp_path / "parts", [StopAt(stop)])
    resumed = run(tmp_path / "parts", ckpt_path="last")

    def rates(module: OurBody) -> list[float]:
        return [lr for _, hook, _, _, lr in module.seen if hook == "training_step"]

    assert rates(resumed) == rates(whole)[stop:]
