"""A fit whose max_steps falls on an epoch's last batch has finished that epoch: resumed, it starts the next one
and runs each epoch's end hooks once, as an uninterrupted fit does (it ran epoch 0's end twice)."""

from __future__ import annotations

from helpers import Regression, quiet, regression_loader

from callbacks import Callback
from trainer import Trainer

BATCHES = 4  # per epoch: 64 samples in batches of 16


class EpochEnds(Callback):
    def __init__(self) -> None:
        self.ends: list[tuple[int, int]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.ends.append((trainer.current_epoch, trainer.global_step))


def run(root, max_steps: int, ckpt_path=None) -> tuple[list[tuple[int, int]], Trainer]:
    ends = EpochEnds()
    trainer = Trainer(max_steps=max_steps, seed=0, default_root_dir=root, callbacks=[ends], **quiet())
    trainer.fit(Regression(optimizer="sgd"), regression_loader(n=16 * BATCHES), ckpt_path=ckpt_path)
    return ends.ends, trainer


def test_a_resume_after_max_steps_on_an_epoch_boundary_ends_each_epoch_once(tmp_path):
    whole, _ = run(tmp_path / "whole", 2 * BATCHES)
    first, stopped = run(tmp_path / "split", BATCHES)
    assert stopped.current_epoch == 1  # epoch 0 is done, as Lightning counts it
    second, _ = run(tmp_path / "split", 2 * BATCHES, ckpt_path="last")
    assert whole == [(0, BATCHES), (1, 2 * BATCHES)]
    assert first + second == whole
