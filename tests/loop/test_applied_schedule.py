"""The learning rate the optimizer actually applies, step by step, under the Trainer's `lr_schedule`.

The expectation is a closed form written here, from the documented definition (not from
trainer.core.schedules): optimizer step s (0-based) of a run of T optimizer steps, warmup W, floor ratio r
and peak lr P (the lr `configure_optimizers` gave the optimizer) uses P * m(s) with

    s < W      m = (s + 1) / W
    constant   m = 1
    linear     m = 1 - (1 - r) * p                      p = (s - W) / (T - W)
    cosine     m = r + (1 - r) * (1 + cos(pi * p)) / 2
    wsd        m = 1 before D = T - round(0.2 * T), then 1 - (1 - r) * (s - D) / (T - D)

The schedule counts optimizer steps, so `accumulate_grad_batches` must not change it.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import Regression, StopAt, quiet, read_metrics, regression_loader

from callbacks import Callback
from trainer import Trainer

PEAK = 0.05
RATIO = 0.25  # not the Trainer's default (0.1)
WARMUP = 4
TOTAL = 20
SCHEDULES = ("constant", "linear", "cosine", "wsd")


def expected_multiplier(name: str, s: int, warmup: int, total: int, ratio: float) -> float:
    if s < warmup:
        return (s + 1) / warmup
    if name == "constant":
        return 1.0
    if name == "wsd":
        decay_start = max(warmup, total - round(0.2 * total))
        if s < decay_start:
            return 1.0
        return 1.0 - (1.0 - ratio) * min(1.0, (s - decay_start) / (total - decay_start))
    p = min(1.0, (s - warmup) / (total - warmup))
    if name == "linear":
        return 1.0 - (1.0 - ratio) * p
    return ratio + (1.0 - ratio) * (1.0 + math.cos(math.pi * p)) / 2.0


def expected_lrs(name: str, warmup: int = WARMUP, total: int = TOTAL, ratio: float = RATIO) -> list[float]:
    return [PEAK * expected_multiplier(name, s, warmup, total, ratio) for s in range(total)]


class AppliedLR(Callback):
    """{optimizer step (0-based): the lr in the optimizer's param group as it is about to step}, and the
    lr the step really applied, measured from the SGD update: delta = -lr * grad."""

    def __init__(self) -> None:
        self.lr: dict[int, float] = {}
        self.effective: dict[int, float] = {}
        self._before: list[torch.Tensor] = []
        self._grads: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        assert trainer.global_step not in self.lr, f"optimizer step {trainer.global_step} seen twice"
        self.lr[trainer.global_step] = optimizer.param_groups[0]["lr"]
        self._before = [p.detach().clone() for p in module.parameters()]
        self._grads = [p.grad.detach().clone() for p in module.parameters()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        delta = torch.cat(
            [(b - p.detach()).flatten() for b, p in zip(self._before, module.parameters(), strict=True)]
        )
        grad = torch.cat([g.flatten() for g in self._grads]).double()
        # least-squares lr of delta = lr * grad
        self.effective[trainer.global_step - 1] = float((delta.double() @ grad) / (grad @ grad))


class CountingRegression(Regression):
    def __init__(self) -> None:
        super().__init__(lr=PEAK, optimizer="sgd")
        self.micro_batches = 0

    def training_step(self, batch, batch_idx):
        self.micro_batches += 1
        return super().training_step(batch, batch_idx)


def fit_recording(root, schedule, max_steps=TOTAL, stop_at=None, ckpt_path=None, ratio=RATIO, **kwargs):
    torch.manual_seed(0)
    module, recorder = CountingRegression(), AppliedLR()
    callbacks = [recorder] + ([StopAt(stop_at)] if stop_at is not None else [])
    trainer = Trainer(
        max_steps=max_steps,
        seed=0,
        default_root_dir=root,
        lr_schedule=schedule,
        warmup_steps=WARMUP,
        min_lr_ratio=ratio,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        **quiet(**kwargs),
    )
    trainer.fit(module, regression_loader(batch_size=16, shuffle=True), ckpt_path=ckpt_path)
    return trainer, module, recorder


def assert_curve(got: dict[int, float], expected: list[float], steps) -> None:
    steps = list(steps)
    assert sorted(got) == steps, f"recorded optimizer steps {sorted(got)}, expected {steps}"
    wrong = [(s, got[s], expected[s]) for s in steps if got[s] != pytest.approx(expected[s], rel=1e-9)]
    assert not wrong, f"(step, applied lr, closed form) where they differ: {wrong}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_applied_lr_follows_the_closed_form_with_warmup_floor_and_accumulation(tmp_path, schedule):
    trainer, module, recorder = fit_recording(tmp_path, schedule)
    expected = expected_lrs(schedule)
    assert trainer.global_step == TOTAL and module.micro_batches == 2 * TOTAL  # 2 micro-batches a step
    assert_curve(recorder.lr, expected, range(TOTAL))
    # the update the optimizer made used that lr (SGD: delta = lr * grad)
    wrong = [
        (s, recorder.effective[s], expected[s])
        for s in range(TOTAL)
        if recorder.effective[s] != pytest.approx(expected[s], rel=1e-3)
    ]
    assert not wrong, f"(step, lr measured from the update, closed form): {wrong}"
    # and the logged train/lr (logged at step s + 1) is the lr that step used
    logged = read_metrics(tmp_path, "train/lr")
    assert [logged[s + 1] for s in range(TOTAL)] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_floor_of_zero_decays_towards_zero(tmp_path, schedule):
    _, _, recorder = fit_recording(tmp_path, schedule, ratio=0)
    expected = expected_lrs(schedule, ratio=0.0)
    assert_curve(recorder.lr, expected, range(TOTAL))
    assert recorder.lr[TOTAL - 1] < PEAK * 0.1  # below where the default floor (0.1) would stop it


def test_a_floor_of_one_holds_the_peak_after_warmup(tmp_path):
    _, _, recorder = fit_recording(tmp_path, "cosine", ratio=1)
    assert_curve(recorder.lr, expected_lrs("cosine", ratio=1.0), range(TOTAL))
    assert [recorder.lr[s] for s in range(WARMUP, TOTAL)] == [PEAK] * (TOTAL - WARMUP)


def test_a_constant_schedule_warms_up_through_a_run_shorter_than_its_warmup(tmp_path):
    trainer, _, recorder = fit_recording(tmp_path, "constant", max_steps=WARMUP - 1)
    assert trainer.global_step == WARMUP - 1
    assert_curve(recorder.lr, expected_lrs("constant", total=WARMUP - 1), range(WARMUP - 1))


# stopped mid-epoch (16 micro-batches per epoch = 8 optimizer steps) and inside the decay
@pytest.mark.parametrize("schedule, stop", [("cosine", 9), ("linear", 9), ("wsd", 17)])
def test_a_resumed_run_continues_the_same_lr_curve(tmp_path, schedule, stop):
    _, _, straight = fit_recording(tmp_path / "straight", schedule)
    first_trainer, _, first = fit_recording(tmp_path / "resumed", schedule, stop_at=stop)
    assert first_trainer.global_step == stop
    second_trainer, _, second = fit_recording(tmp_path / "resumed", schedule, ckpt_path="last")
    assert second_trainer.global_step == TOTAL and second_trainer.state.restarts == 1

    expected = expected_lrs(schedule)
    assert_curve(first.lr, expected, range(stop))
    assert_curve(second.lr, expected, range(stop, TOTAL))
    assert {**first.lr, **second.lr} == straight.lr
    # the resumed steps also applied that lr
    for s in range(stop, TOTAL):
        assert second.effective[s] == pytest.approx(expected[s], rel=1e-3), f"step {s}"


def test_the_run_length_from_epochs_limit_and_accumulation_sets_the_decay(tmp_path):
    """Without max_steps, T = max_epochs x ceil(limited micro-batches / accumulation) = 3 x ceil(7 / 2)."""
    torch.manual_seed(0)
    module, recorder = CountingRegression(), AppliedLR()
    trainer = Trainer(
        max_epochs=3,
        limit_train_batches=7,
        accumulate_grad_batches=2,
        lr_schedule="linear",
        warmup_steps=2,
        min_lr_ratio=RATIO,
        seed=0,
        default_root_dir=tmp_path,
        callbacks=[recorder],
        **quiet(enable_checkpointing=False),
    )
    trainer.fit(module, regression_loader(batch_size=16))
    total = 3 * 4
    assert trainer.global_step == total and module.micro_batches == 3 * 7
    expected = [PEAK * expected_multiplier("linear", s, 2, total, RATIO) for s in range(total)]
    assert_curve(recorder.lr, expected, range(total))
