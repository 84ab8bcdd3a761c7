"""Evaluation from the user's side: what `trainer.test(ckpt_path=...)` evaluates, when a fractional
`val_check_interval` validates, and the error a callback's `trainer.loss_on` gives for a bad
`validation_step`."""

from __future__ import annotations

import pytest
import torch
from helpers import Regression, checkpoint_steps, fit, quiet, read_metrics, regression_loader

from callbacks import Callback
from trainer import Trainer


class WithTest(Regression):
    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)


def mean_loss(module: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(
            torch.stack([torch.nn.functional.mse_loss(module(x), y) for x, y in regression_loader()]).mean()
        )


def test_test_with_ckpt_path_evaluates_the_checkpointed_weights(tmp_path):
    trained = WithTest()
    fit(trained, regression_loader(), tmp_path / "run", 20)
    (step,) = checkpoint_steps(tmp_path / "run")
    path = tmp_path / "run" / "checkpoints" / f"step-{step:08d}"
    assert path.is_dir()

    fresh = WithTest()
    untrained = mean_loss(fresh)
    tested = Trainer(default_root_dir=tmp_path / "eval", **quiet()).test(
        fresh, regression_loader(), ckpt_path=path
    )
    assert tested["test/loss"] == pytest.approx(mean_loss(trained), rel=1e-6)
    assert tested["test/loss"] != pytest.approx(untrained, rel=1e-3)  # the checkpoint made the difference


@pytest.mark.parametrize(
    "interval, accumulate, expected",
    [
        (0.5, 1, [4, 8, 12, 16]),  # 8 steps per epoch: every 4
        (0.5, 2, [2, 4, 6, 8]),  # 8 micro-batches, 4 steps per epoch: every 2
        (0.25, 1, [2, 4, 6, 8]),
        (1.0, 2, [4, 8]),  # once per epoch
    ],
)
def test_a_fractional_val_check_interval_validates_that_share_of_an_epochs_steps(
    tmp_path, interval, accumulate, expected
):
    fit(
        Regression(),
        regression_loader(n=128),  # 8 batches of 16
        tmp_path,
        expected[-1],
        val_loader=regression_loader(n=32),
        val_check_interval=interval,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=False,
    )
    assert list(read_metrics(tmp_path, "val/loss")) == expected


class PerSampleValidation(Regression):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y, reduction="none")  # not a scalar


class LossOnFirstBatch(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        trainer.loss_on(trainer.first_train_batch)


def test_loss_on_names_validation_step_when_it_returns_no_scalar_loss(tmp_path):
    with pytest.raises(
        TypeError,
        match=r"validation_step returned Tensor; allowed: a scalar loss tensor or a dict with a 'loss'",
    ):
        fit(
            PerSampleValidation(),
            regression_loader(),
            tmp_path,
            2,
            callbacks=[LossOnFirstBatch()],
            enable_checkpointing=False,
        )


class Stages(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def setup(self, trainer, module, stage):
        self.seen.append(("setup", stage))

    def teardown(self, trainer, module, stage):
        self.seen.append(("teardown", stage))


def test_callbacks_are_told_which_stage_sets_up_and_tears_down(tmp_path):
    stages = Stages()
    trainer = Trainer(default_root_dir=tmp_path, callbacks=[stages], **quiet(enable_checkpointing=False))
    trainer.validate(WithTest(), regression_loader())
    trainer.test(WithTest(), regression_loader())
    assert stages.seen == [
        ("setup", "validate"),
        ("teardown", "validate"),
        ("setup", "test"),
        ("teardown", "test"),
    ]
