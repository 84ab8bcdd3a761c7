"""Productive time: only the seconds of optimizer steps the model kept count.

No wall clock is read: the `time.perf_counter` that trainer/loop/fit_loop.py sees is replaced by a fake clock
that moves only when the test moves it (1 s per training_step call, and large stalls in validation and
after each step that must never count), so the expected value is exact: kept steps x seconds per step.
"""

from __future__ import annotations

import pytest
import torch
from helpers import FakeClock, Regression, StopAt, fake_time, quiet, regression_loader

from callbacks import Callback, ModelCheckpoint, NaNGuard
from trainer import Trainer

STEP_S = 1.0  # fake seconds per training_step call (one micro-batch)
VAL_S = 100.0  # fake seconds per validation_step call: never productive
STALL_S = 10.0  # fake seconds after each step (logging, checkpoints): never productive


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """trainer/loop/fit_loop.py's `time`, with only perf_counter faked (time.time etc. stay real, and no other
    module, trainer.core.timing included, sees the fake)."""
    fake = FakeClock()
    fake_time(monkeypatch, "trainer.loop.fit_loop", fake, "perf_counter")
    return fake


class Timed(Regression):
    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock, self.calls = clock, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        self.clock.advance(STEP_S)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.clock.advance(VAL_S)
        return super().validation_step(batch, batch_idx)


class Poison(Callback):
    """NaN gradients in the chosen optimizer steps (1-based), each once."""

    def __init__(self, steps) -> None:
        self.steps = set(steps)

    def on_after_backward(self, trainer, module):
        if trainer.global_step + 1 in self.steps:
            self.steps.discard(trainer.global_step + 1)
            next(module.parameters()).grad.fill_(float("nan"))


class Stall(Callback):
    """Time after each step's update (as a slow logger or checkpoint write would take)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.clock.advance(STALL_S)


def fit(root, clock, steps, callbacks, ckpt_path=None, **kwargs) -> Trainer:
    torch.manual_seed(0)
    trainer = Trainer(max_steps=steps, seed=0, default_root_dir=root, callbacks=callbacks, **quiet(**kwargs))
    trainer.fit(Timed(clock), regression_loader(shuffle=True), regression_loader(n=32), ckpt_path=ckpt_path)
    return trainer


def assert_productive(trainer: Trainer, expected: float) -> None:
    assert trainer.state.productive_s == pytest.approx(expected, abs=1e-9)
    assert trainer.effective_training_time()["productive_s"] == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_skipped_steps_and_stalls_are_not_productive(tmp_path, clock, accumulate):
    trainer = fit(
        tmp_path,
        clock,
        8,
        [Poison([3, 5, 6]), NaNGuard(rollback_after=None), Stall(clock)],
        accumulate_grad_batches=accumulate,
        val_check_interval=2,
    )
    assert trainer.global_step == 8 and trainer.state.skipped_steps == 3
    assert_productive(trainer, 5 * accumulate * STEP_S)  # 5 kept steps of `accumulate` micro-batches


def test_without_skips_every_step_is_productive(tmp_path, clock):
    trainer = fit(tmp_path, clock, 6, [NaNGuard(rollback_after=None), Stall(clock)], val_check_interval=2)
    assert trainer.state.skipped_steps == 0
    assert_productive(trainer, 6 * STEP_S)


def test_a_resume_continues_the_productive_time_of_the_checkpoint(tmp_path, clock):
    first = fit(tmp_path, clock, 8, [Poison([2, 6]), NaNGuard(rollback_after=None), StopAt(4)])
    assert first.global_step == 4
    assert_productive(first, 3 * STEP_S)  # steps 1, 3, 4
    second = fit(tmp_path, clock, 8, [Poison([2, 6]), NaNGuard(rollback_after=None)], ckpt_path="last")
    assert second.global_step == 8 and second.state.skipped_steps == 2
    assert_productive(second, 6 * STEP_S)  # steps 1, 3, 4, 5, 7, 8


def test_steps_undone_by_a_rollback_are_not_productive(tmp_path, clock):
    # steps 1-6 kept, 7-8 skipped -> rollback to step 4; steps 5-10 taken again: 14 steps run, 10 kept
    guard = NaNGuard(rollback_after=2)
    trainer = fit(
        tmp_path, clock, 10, [Poison([7, 8]), ModelCheckpoint(every_n_steps=4, save_top_k=-1), guard]
    )
    assert trainer.global_step == 10 and guard.rollbacks == 1 and trainer.module.calls == 14
    assert_productive(trainer, 10 * STEP_S)
