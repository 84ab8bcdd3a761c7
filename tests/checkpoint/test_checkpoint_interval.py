"""The checkpoint interval from the failure rate: Young/Daly's formula on given numbers (checked against a
direct minimisation of the time lost), `ModelCheckpoint(every_n_steps="auto")` choosing its interval in
real fits from the save cost it measured (a fake clock makes the cost exact where a test needs a number),
and bad values refused in one line."""

from __future__ import annotations

import logging
import math

import pytest
from helpers import FakeClock, Regression, checkpoint_steps, fake_time, read_metrics, regression_loader

from callbacks import Callback, ModelCheckpoint
from strategies.plan.checkpoint_interval import effective_fraction, young_daly_interval
from trainer import Trainer


def lost(save_cost_s: float, interval_s: float, mtbf_s: float) -> float:
    """Share of time lost, written out: saving (C per T) and, per failure, half an interval redone."""
    return save_cost_s / interval_s + interval_s / 2 / mtbf_s


@pytest.mark.parametrize(
    "save_cost_s, mtbf_s",
    [
        (60.0, 24 * 3600.0),  # a minute's save, a failure a day
        (20.0, 54 * 24 * 3600.0 / 466),  # Llama 3 405B's pretraining: 466 interruptions in 54 days
        (0.5, 3600.0),
    ],
)
def test_young_daly_interval_is_the_interval_that_loses_least(save_cost_s, mtbf_s):
    interval = young_daly_interval(save_cost_s, mtbf_s)
    grid = [interval * (0.5 + i / 1000) for i in range(1001)]  # 0.5x .. 1.5x
    best = min(grid, key=lambda t: lost(save_cost_s, t, mtbf_s))
    assert best == pytest.approx(interval, rel=2e-3)
    # at the optimum both losses are sqrt(C / 2M)
    expected = 1 - 2 * math.sqrt(save_cost_s / (2 * mtbf_s))
    assert effective_fraction(save_cost_s, interval, mtbf_s) == pytest.approx(expected, rel=1e-12)


def test_young_daly_on_given_numbers():
    assert young_daly_interval(60.0, 86400.0) == pytest.approx(3219.94, abs=0.01)  # sqrt(10,368,000)
    assert effective_fraction(60.0, 3600.0, 86400.0) == pytest.approx(1 - 1 / 60 - 1 / 48)
    assert effective_fraction(60.0, 3600.0, 86400.0, restart_s=600.0) == pytest.approx(
        1 - 1 / 60 - 1 / 48 - 1 / 144
    )
    assert effective_fraction(100.0, 10.0, 86400.0) == 0.0  # saving costs more than the interval
    for bad in (
        lambda: young_daly_interval(-1.0, 3600.0),
        lambda: young_daly_interval(1.0, 0.0),
        lambda: young_daly_interval(float("nan"), 3600.0),
        lambda: effective_fraction(1.0, 0.0, 3600.0),
    ):
        with pytest.raises(ValueError, match="is invalid; allowed"):
            bad()


class Tick(Callback):
    """Moves the checkpoint module's clock: `step_s` per optimizer step, `save_s` per save."""

    def __init__(self, clock: FakeClock, step_s: float, save_s: float) -> None:
        self.clock, self.step_s, self.save_s = clock, step_s, save_s

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.clock.advance(self.step_s)

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self.clock.advance(self.save_s)


@pytest.fixture
def trainer_info():
    """The messages of the "trainer" logger at INFO (attached directly: the console set-up may not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("trainer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_auto_interval_comes_from_the_measured_save_cost_and_step_time(tmp_path, monkeypatch, trainer_info):
    clock = FakeClock()
    fake_time(monkeypatch, "callbacks.checkpoint", clock, "monotonic")
    # a step takes 1 s, a save 1 s, a failure every 12.5 s: sqrt(2 * 1 * 12.5) = 5 s = 5 steps
    checkpoint = ModelCheckpoint(every_n_steps="auto", mtbf_hours=12.5 / 3600, save_top_k=-1)
    trainer = Trainer(
        max_steps=12,
        default_root_dir=tmp_path,
        callbacks=[Tick(clock, step_s=1.0, save_s=1.0), checkpoint],
        enable_progress_bar=False,
        log_every_n_steps=1,
    )
    trainer.fit(Regression(), regression_loader())
    assert checkpoint.save_cost_s == pytest.approx(1.0) and checkpoint.step_time_s == pytest.approx(1.0)
    assert checkpoint.interval_s == pytest.approx(5.0) and checkpoint.every_n_steps == 5
    assert checkpoint.effective_fraction == pytest.approx(1 - 1 / 5 - 5 / 25)
    # the timed first save at step 3, then every 5 steps, and the last at the end
    assert checkpoint_steps(tmp_path) == [3, 5, 10, 12]
    line = next(r.getMessage() for r in trainer_info if "every_n_steps='auto'" in r.getMessage())
    assert "every 5 steps" in line and "60.00%" in line, line
    assert read_metrics(tmp_path, "checkpoint/every_n_steps") == {3: 5.0}


def test_auto_interval_in_a_real_fit_follows_its_measured_numbers(tmp_path):
    checkpoint = ModelCheckpoint(every_n_steps="auto", mtbf_hours=1e-4, save_top_k=-1)
    Trainer(max_steps=8, default_root_dir=tmp_path, callbacks=[checkpoint], enable_progress_bar=False).fit(
        Regression(), regression_loader()
    )
    cost, step = checkpoint.save_cost_s, checkpoint.step_time_s
    assert cost > 0 and step > 0
    assert checkpoint.every_n_steps == max(1, round(math.sqrt(2 * cost * 0.36) / step))
    n = checkpoint.every_n_steps
    assert checkpoint_steps(tmp_path) == sorted({3, *range(n, 9, n), 8})


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"every_n_steps": "often"}, "every_n_steps='often' is invalid; allowed: an int >= 1, 'auto'"),
        ({"every_n_steps": "auto"}, "needs mtbf_hours"),
        ({"every_n_steps": "auto", "mtbf_hours": 0}, "mtbf_hours=0 is invalid"),
        ({"every_n_steps": "auto", "mtbf_hours": -2.0}, "mtbf_hours=-2.0 is invalid"),
        ({"every_n_steps": "auto", "mtbf_hours": "2"}, "mtbf_hours='2' is invalid"),
        ({"every_n_steps": 100, "mtbf_hours": 2.0}, "without every_n_steps='auto'"),
    ],
)
def test_bad_auto_interval_values_are_one_line_errors(kwargs, words):
    with pytest.raises(ValueError, match="^[^\n]*$") as err:
        ModelCheckpoint(**kwargs)
    assert words in str(err.value)
