"""`val_check_interval` as a time (Lightning 2.6: "DD:HH:MM:SS", a timedelta or a dict of timedelta fields): a
validation follows the step after which `time.monotonic()` has moved that far since the last validation ended
(or since training started), none at epoch ends; `check_val_every_n_epoch` still picks the epochs. Both
Trainers run on the same fake monotonic clock, which a callback moves at each batch's start and during each
validation: they validate after the same steps (no sleep, no wall-clock)."""

from __future__ import annotations

import datetime
import time

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback
from trainer import Trainer, TrainModule
from trainer.loop.val_timer import ValTimer

# seconds each step's batch takes (global step 0..11: 3 epochs of 4 batches), and each validation
STEP_SECONDS = [2, 2, 2, 1, 3, 1, 1, 1, 4, 2, 2, 2]
VALIDATION_SECONDS = 3


class Body:
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LitBody(Body, pl.LightningModule):
    pass


class OurBody(Body, TrainModule):
    pass


class FakeClock:
    """What `time.monotonic` returns during the test: moved only by `Ticks`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ticks(base: type, clock: FakeClock) -> Callback:
    """Moves `clock` by the step's seconds at each batch's start and by VALIDATION_SECONDS during each
    validation; records the global step after which each validation runs."""

    class Ticks(base):
        def __init__(self) -> None:
            self.validated_after: list[int] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            clock.now += STEP_SECONDS[trainer.global_step]

        def on_validation_start(self, trainer, module):
            self.validated_after.append(trainer.global_step)

        def on_validation_epoch_end(self, trainer, module):
            clock.now += VALIDATION_SECONDS

    return Ticks()


def data(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


def validations(framework: str, monkeypatch, interval, check_val_every_n_epoch) -> list[int]:
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    flags = dict(
        max_epochs=3,
        val_check_interval=interval,
        check_val_every_n_epoch=check_val_every_n_epoch,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if framework == "lightning":
        callback = ticks(pl.Callback, clock)
        pl.Trainer(accelerator="cpu", devices=1, callbacks=[callback], **flags).fit(
            LitBody(), data(16), data(8)
        )
    else:
        callback = ticks(Callback, clock)
        Trainer(callbacks=[callback], **flags).fit(OurBody(), data(16), data(8))
    monkeypatch.undo()
    return callback.validated_after


@pytest.mark.parametrize(
    "interval",
    ["00:00:00:05", datetime.timedelta(seconds=5), {"seconds": 5}],
    ids=["str", "timedelta", "dict"],
)
@pytest.mark.parametrize("check_val_every_n_epoch", [1, 2, None])
def test_time_based_validation_runs_after_the_steps_lightnings_does(
    monkeypatch, interval, check_val_every_n_epoch
):
    theirs = validations("lightning", monkeypatch, interval, check_val_every_n_epoch)
    ours = validations("ours", monkeypatch, interval, check_val_every_n_epoch)
    assert theirs, "the clock should make some validation due"
    # a fit here also ends with a validation when its last step had none (Lightning: none)
    assert ours == theirs + ([12] if theirs[-1] != 12 else [])


@pytest.mark.parametrize("value", ["5 minutes", "00:00:05", {"minute": 5}, datetime.timedelta(0), 1.5, -1])
def test_a_bad_val_check_interval_is_named_with_what_is_allowed(value):
    with pytest.raises(ValueError, match=r"val_check_interval=.* is invalid; allowed: .*'DD:HH:MM:SS'"):
        Trainer(val_check_interval=value)


def test_several_processes_validate_on_the_slowest_clock_compared_at_agreed_steps(monkeypatch):
    """Every rank validates after the same step: the slowest rank's time since the last validation decides,
    read at steps all of them agree on (as for max_time), not after every step."""
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    compared = []

    def slowest(elapsed: float) -> float:  # the collective: another rank's clock is 1 s ahead of this one
        compared.append(elapsed)
        return elapsed + 1.0

    timer = ValTimer(10.0, agreed=True, slowest=slowest)
    timer.restart(0)
    due = []
    for step in range(1, 12):
        clock.now += 1.0
        if timer.due(step):
            due.append(step)
            break
    assert due == [9]  # 9 s on this clock, 10 on the other rank's
    assert len(compared) == 7  # at steps 1, 3, 5, 6, 7, 8, 9
