"""Timer: a signal or a near deadline ends the fit with a checkpoint, and the run resumes exactly."""

from __future__ import annotations

import logging
import os
import signal
from datetime import timedelta

import pytest
import torch
from helpers import FakeClock, Regression, fake_time, fit, regression_loader

from callbacks import Callback, ModelCheckpoint, Timer


def run(root, steps, callbacks, ckpt_path=None):
    torch.manual_seed(0)  # the same initial weights in every run of a test
    module = Regression(dropout=0.1)
    return module, fit(
        module, regression_loader(shuffle=True), root, steps, callbacks=callbacks, ckpt_path=ckpt_path
    )


class SendSignal(Callback):
    def __init__(self, step, signum):
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)  # arrives in the middle of the step


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_the_run_resumes_exactly(
    tmp_path, caplog, signum
):
    straight, _ = run(tmp_path / "straight", 8, [])
    root = tmp_path / "run"
    before = signal.getsignal(signum)
    with caplog.at_level(logging.INFO, logger="trainer"):
        _, trainer = run(root, 8, [SendSignal(3, signum), Timer(), ModelCheckpoint(every_n_steps=100)])
    assert trainer.global_step == 3
    assert signal.getsignal(signum) is before  # the handler is the user's again after fit
    assert any(f"stopping at step 3 (received {signum.name})" in r.message for r in caplog.records)
    assert (root / "checkpoints" / "step-00000003" / "validated.json").exists()
    resumed, _ = run(root, 8, [Timer()], ckpt_path="last")
    for p, q in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(p, q)


class Takes(Callback):
    """Each step takes `seconds` on the Timer's (fake) clock: listed before the Timer, it moves the clock
    between the Timer's step start and step end."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.clock.advance(self.seconds)


def test_a_near_deadline_stops_early_with_a_checkpoint(tmp_path, caplog, monkeypatch):
    clock = FakeClock()
    fake_time(monkeypatch, "callbacks.timer", clock, "monotonic")
    with caplog.at_level(logging.INFO, logger="trainer"):
        # 1 s steps, a 100 s limit: after step k, k s have passed and the longest step is 1 s, so the
        # first step that ends with less than 1 s to spare (99 + 1 >= 100) is 99
        _, trainer = run(tmp_path, 1000, [Takes(clock, 1.0), Timer(duration=100)])
    assert trainer.global_step == 99
    assert any("the 100 s time limit is near" in r.message for r in caplog.records)
    assert (tmp_path / "checkpoints" / f"step-{trainer.global_step:08d}").exists()


@pytest.mark.parametrize(
    "duration, seconds", [(90, 90.0), ("00:01:30:00", 5400.0), (timedelta(minutes=2), 120.0), (None, None)]
)
def test_durations(duration, seconds):
    assert Timer(duration=duration).duration_s == seconds


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"duration": "1h"}, "duration='1h' is invalid; allowed: seconds, a timedelta or 'DD:HH:MM:SS'"),
        ({"duration": -5}, "duration=-5 is invalid; allowed: a positive length of time"),
        ({"signals": ("SIGNOPE",)}, "signals: 'SIGNOPE' is not a signal name"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Timer(**kwargs)
