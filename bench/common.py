"""Shared by the benchmarks: time a hand-written loop and the Trainer on the same work, alternately or
interleaved step by step."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from callbacks import Callback
from trainer import Trainer


class StepClock(Callback):
    """Timestamps at the end of every optimizer step of a Trainer run."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())


def seconds_per_step(stamps: list[float], skip: int) -> float:
    """Median step time after `skip` warm-up steps."""
    return statistics.median(b - a for a, b in zip(stamps[skip:], stamps[skip + 1 :], strict=False))


def fit_timed(module: Any, loader: Any, clock: StepClock, root: str, steps: int, warmup: int) -> None:
    """The Trainer side of a benchmark (see `build_trainer`), fitted."""
    build_trainer(clock, root, steps, warmup).fit(module, loader)


def build_trainer(clock: Callback, root: str, steps: int, warmup: int) -> Trainer:
    """A Trainer with the same schedule and clipping as the hand loops, logging every 10 steps, progress
    bar on, no checkpoints (the hand loops write none), and `clock` as its callback."""
    return Trainer(
        max_steps=steps,
        lr_schedule="cosine",
        warmup_steps=warmup,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        enable_progress_bar=True,
        enable_checkpointing=False,
        callbacks=[clock],
        default_root_dir=root,
    )


class Interleaved(Callback):
    """Runs one step of a hand-written loop (`hand_step()`) at the end of each Trainer step and times both
    apart: a Trainer step lasts from the end of one hand step to the start of the next. Both loops so
    meet the same moments of a shared machine, and their times pair up step by step. Also records what a
    fit costs around its steps: `startup_s`, from calling `fit` (`called_at`, set by the caller) to the
    first step starting, less that step's batch fetch; `last_step_end`, where the fit's teardown starts."""

    def __init__(self, hand_step: Callable[[], None]) -> None:
        self.hand_step = hand_step
        self.hand: list[float] = []  # hand step k
        self.trainer: list[float] = []  # Trainer step k + 1 (step 0 has no hand step before it)
        self.called_at = 0.0
        self.startup_s: float | None = None
        self.last_step_end = 0.0

    def on_fit_start(self, trainer, module) -> None:
        trainer.clock.watch(self)  # for the first step's batch fetch (the clock runs while read)

    def on_train_batch_start(self, trainer, module, batch, batch_idx: int) -> None:
        if self.startup_s is None:
            trainer.clock.unwatch(self)
            fetch = trainer.clock.totals["data"]  # the first step's batch (the only span watched)
            self.startup_s = time.perf_counter() - self.called_at - fetch

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        start = time.perf_counter()
        if self.hand:
            self.trainer.append(start - self.last_step_end)
        self.hand_step()
        self.last_step_end = time.perf_counter()
        self.hand.append(self.last_step_end - start)

    def windows(self, skip: int, window: int) -> list[tuple[float, float]]:
        """(Trainer seconds, hand seconds) of each sliding window of `window` steps after `skip`: a window
        as long as the logging interval holds one logged step of each loop."""
        hand, ours = self.hand[1:], self.trainer  # both from step 1 on
        last = min(len(hand), len(ours)) - window
        return [(sum(ours[i : i + window]), sum(hand[i : i + window])) for i in range(skip, last + 1)]


def compare(
    hand: Callable[[], list[float]], framework: Callable[[StepClock, str], None], rounds: int, skip: int
) -> tuple[float, float]:
    """Alternate the two runs `rounds` times (so drift hits both); returns each one's best median step
    time over the rounds (the least disturbed by other work on the machine, as timeit does)."""
    hand_times, trainer_times = [], []
    for _ in range(rounds):
        torch.manual_seed(0)
        hand_times.append(seconds_per_step(hand(), skip))
        clock = StepClock()
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as root:
            framework(clock, root)
        trainer_times.append(seconds_per_step(clock.stamps, skip))
    return min(hand_times), min(trainer_times)
