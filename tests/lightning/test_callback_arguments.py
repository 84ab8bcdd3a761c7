"""What callbacks are handed, as Lightning users read it: the batch index at a step's start, and the
strategy "auto" picks for the number of processes."""

from __future__ import annotations

from helpers import Regression, fit, regression_loader

from callbacks import Callback
from strategies import DDPStrategy, SingleDeviceStrategy
from trainer import Trainer


class StepStarts(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append((trainer.current_epoch, batch_idx))


def test_a_step_starts_with_the_index_of_its_first_micro_batch_in_the_epoch(tmp_path):
    """8 micro-batches per epoch, 2 per step: steps start at batches 0, 2, 4, 6 of each epoch."""
    starts = StepStarts()
    fit(
        Regression(),
        regression_loader(batch_size=32),
        tmp_path,
        8,
        accumulate_grad_batches=2,
        callbacks=[starts],
        enable_checkpointing=False,
    )
    assert starts.seen == [(epoch, i) for epoch in (0, 1) for i in (0, 2, 4, 6)]


def test_auto_is_one_process_for_one_device_and_ddp_for_several():
    assert isinstance(Trainer(strategy="auto", devices=1).strategy, SingleDeviceStrategy)
    assert isinstance(Trainer(strategy="auto", devices=2).strategy, DDPStrategy)
