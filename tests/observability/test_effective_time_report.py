"""The line a finished fit prints about its effective training time: the share of wall-clock time since the
run started that went into kept steps. trainer/loop/fit_loop.py's clocks (`perf_counter` for steps, `time` for the
run's start) are one fake clock that moves 1 s per training_step and 3 s after each step, so the share is
exactly 25%."""

from __future__ import annotations

import logging

from helpers import FakeClock, Regression, fake_time, fit, regression_loader

from callbacks import Callback


class OneSecondSteps(Regression):
    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def training_step(self, batch, batch_idx):
        self.clock.advance(1.0)
        return super().training_step(batch, batch_idx)


class ThreeSecondStalls(Callback):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.clock.advance(3.0)


def test_a_finished_fit_reports_its_effective_training_time(tmp_path, monkeypatch, caplog):
    clock = FakeClock()
    fake_time(monkeypatch, "trainer.loop.fit_loop", clock, "perf_counter", "time")
    with caplog.at_level(logging.INFO, logger="trainer"):
        fit(
            OneSecondSteps(clock),
            regression_loader(),
            tmp_path,
            4,
            callbacks=[ThreeSecondStalls(clock)],
            enable_checkpointing=False,
        )
    lines = [r.getMessage() for r in caplog.records if "effective training time" in r.getMessage()]
    assert lines == [
        "effective training time 25.0%: 4.0 s in kept steps of 16.0 s since the run started "
        "(0 restart(s)/rollback(s), 0 skipped step(s))"
    ]
