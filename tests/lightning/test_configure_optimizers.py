"""Every return form of Lightning's `configure_optimizers`, written as Lightning's docs write them, gives
Lightning's learning rates: schedulers step per epoch unless their interval is "step", every `frequency`
intervals, and ReduceLROnPlateau reads the metric it monitors."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import quiet, read_metrics, regression_loader
from torch import nn

from trainer import Trainer, TrainModule

EPOCH = 4  # batches per epoch: regression_loader(batch_size=16, n=64)


class LitRegressor(TrainModule):
    """A module as Lightning's docs write it; `optimizers` builds what configure_optimizers returns."""

    def __init__(self, optimizers, val_losses=None):
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.build, self.val_losses = optimizers, val_losses

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        # a scripted validation curve (per epoch) when given, so a plateau happens when the test says
        value = (
            self.val_losses[self.trainer.state.epoch - 1]
            if self.val_losses
            else nn.functional.mse_loss(self(x), y)
        )
        self.log("val_loss", value)
        return torch.as_tensor(value)

    def configure_optimizers(self):
        return self.build(torch.optim.SGD(self.parameters(), lr=1.0))


def lrs(tmp_path, optimizers, epochs=3, val_losses=None):
    """The learning rate each optimizer step ran with, over `epochs` epochs of EPOCH steps."""
    module = LitRegressor(optimizers, val_losses)
    Trainer(max_epochs=epochs, default_root_dir=tmp_path, **quiet()).fit(
        module, regression_loader(n=64), regression_loader(n=32)
    )
    return list(read_metrics(tmp_path, "train/lr").values())


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


PER_EPOCH = [1.0] * EPOCH + [0.5] * EPOCH + [0.25] * EPOCH  # Lightning's default interval: the epoch


@pytest.mark.parametrize(
    "form",
    [
        lambda opt: ([opt], [step_lr(opt)]),
        lambda opt: {"optimizer": opt, "lr_scheduler": step_lr(opt)},
        lambda opt: {"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt)}},
        lambda opt: {"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt), "interval": "epoch"}},
        lambda opt: [{"optimizer": opt, "lr_scheduler": step_lr(opt)}],
    ],
    ids=["tuple-of-lists", "dict", "config-dict", "explicit-epoch", "list-of-dict"],
)
def test_a_scheduler_steps_once_per_epoch_by_default(tmp_path, form):
    assert lrs(tmp_path, form) == PER_EPOCH


@pytest.mark.parametrize(
    "form", [lambda opt: opt, lambda opt: [opt], lambda opt: (opt,)], ids=["optimizer", "list", "tuple"]
)
def test_an_optimizer_alone_keeps_its_learning_rate(tmp_path, form):
    assert lrs(tmp_path, form, epochs=1) == [1.0] * EPOCH


def test_a_step_interval_with_frequency_steps_every_nth_optimizer_step(tmp_path):
    def form(opt):
        config = {"scheduler": step_lr(opt), "interval": "step", "frequency": 2, "name": "my-lr"}
        return {"optimizer": opt, "lr_scheduler": config}

    assert lrs(tmp_path, form, epochs=2) == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125]


def test_reduce_on_plateau_is_fed_the_monitored_validation_metric(tmp_path):
    def form(opt):
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": plateau, "monitor": "val_loss"}

    # val_loss improves at epoch 2 and worsens at epoch 3: the lr halves after epoch 3's validation
    lr = lrs(tmp_path, form, epochs=5, val_losses=[1.0, 0.5, 0.7, 0.9, 0.9])
    assert lr == [1.0] * EPOCH * 3 + [0.5] * EPOCH + [0.25] * EPOCH


def test_reduce_on_plateau_monitor_in_the_scheduler_config(tmp_path):
    def form(opt):
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

    assert (
        lrs(tmp_path, form, epochs=3, val_losses=[1.0, 2.0, 3.0])
        == [1.0] * EPOCH * 2 + [0.5] * EPOCH  # 2.0 is worse than 1.0: halved after epoch 2
    )


def test_a_monitor_that_was_never_logged_names_the_logged_metrics(tmp_path):
    def form(opt):
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_acc"}}

    with pytest.raises(KeyError, match=r"monitor 'val_acc' is not among the logged metrics \[.*'val_loss'"):
        lrs(tmp_path, form, epochs=2)


def test_a_non_strict_monitor_that_is_missing_skips_the_step_with_a_warning(tmp_path, caplog):
    def form(opt):
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": plateau, "monitor": "val_acc", "strict": False},
        }

    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert lrs(tmp_path, form, epochs=2) == [1.0] * EPOCH * 2
    assert "lr scheduler monitor 'val_acc' was not logged" in caplog.text


def test_the_scheduler_position_resumes_from_a_checkpoint(tmp_path):
    form = lambda opt: {"optimizer": opt, "lr_scheduler": step_lr(opt)}  # noqa: E731
    module = LitRegressor(form)
    trainer = Trainer(max_epochs=2, default_root_dir=tmp_path, **quiet())
    trainer.fit(module, regression_loader(n=64))
    saved = trainer.save_checkpoint()
    resumed = Trainer(max_epochs=3, default_root_dir=tmp_path / "resumed", **quiet())
    resumed.fit(LitRegressor(form), regression_loader(n=64), ckpt_path=saved)
    assert list(read_metrics(tmp_path / "resumed", "train/lr").values()) == [0.25] * EPOCH


@pytest.mark.parametrize(
    "form, error, match",
    [
        (lambda opt: [opt, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1)], TypeError,
         r"returned 2 optimizers \(SGD, SGD\); several are trained with manual optimization only: set `self.automatic_optimization = False`"),
        (lambda opt: {"lr_scheduler": step_lr(opt)}, TypeError, r"returned a dict without 'optimizer'"),
        (lambda opt: {"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt), "intervall": "step"}}, TypeError,
         r"lr_scheduler config has keys \['intervall', 'scheduler'\]; allowed: 'scheduler' \(required\)"),
        (lambda opt: {"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt), "interval": "batch"}},
         ValueError, r"interval='batch' is invalid; allowed: 'step', 'epoch'"),
        (lambda opt: {"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt), "frequency": 0}},
         ValueError, r"frequency=0 is invalid; allowed: an int >= 1"),
        (lambda opt: {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)},
         ValueError, r"ReduceLROnPlateau needs the metric it watches: add 'monitor'"),
        (lambda opt: ([opt], [step_lr(opt), step_lr(opt)]), TypeError, r"returned 2 lr schedulers; allowed: at most one"),
    ],
)  # fmt: skip
def test_a_form_this_trainer_cannot_run_is_named_before_training(tmp_path, form, error, match):
    with pytest.raises(error, match=match):
        lrs(tmp_path, form, epochs=1)
    assert not (tmp_path / "logs" / "metrics.jsonl").exists() or not read_metrics(tmp_path)
