"""A `training_step` that returns None skips its update but not its place in the lr schedule: as in
Lightning (the optimizer is still called, with no gradients), the scheduler steps, so the steps after it
use the lr the schedule gives their step number."""

from __future__ import annotations

import pytest
import torch
from helpers import Regression, fit, regression_loader


class SkipsBatch(Regression):
    """SGD at lr 1.0; a step-interval scheduler halving it each step (or the Trainer's own schedule);
    batch `skip` returns None. Records the lr each training_step runs at."""

    def __init__(self, skip: int, own_scheduler: bool) -> None:
        super().__init__(lr=1.0, optimizer="sgd")
        self.skip, self.own_scheduler = skip, own_scheduler
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        if batch_idx == self.skip:
            return None
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        if not self.own_scheduler:
            return optimizer
        halving = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halving, "interval": "step"}}


def test_a_none_step_moves_the_modules_scheduler_on(tmp_path):
    module = SkipsBatch(skip=1, own_scheduler=True)
    fit(module, regression_loader(), tmp_path, 4, enable_checkpointing=False)
    assert module.lrs == pytest.approx([1.0, 0.5, 0.25, 0.125])  # batch 1 returned None


def test_a_none_step_moves_the_trainers_schedule_on(tmp_path):
    """The Trainer's linear schedule over 4 steps: 1 - (1 - 0.1) * s / 4 at step s."""
    module = SkipsBatch(skip=1, own_scheduler=False)
    fit(module, regression_loader(), tmp_path, 4, enable_checkpointing=False, lr_schedule="linear")
    assert module.lrs == pytest.approx([1.0, 1 - 0.9 / 4, 1 - 0.9 * 2 / 4, 1 - 0.9 * 3 / 4])
