"""Shared by the benchmarks: time a hand-written loop and the Trainer on the same work, alternately."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from callbacks import Callback


class StepClock(Callback):
    """Timestamps at the end of every optimizer step of a Trainer run."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs) -> None:
        self.stamps.append(time.perf_counter())


def seconds_per_step(stamps: list[float], skip: int) -> float:
    """Median step time after `skip` warm-up steps."""
    return statistics.median(b - a for a, b in zip(stamps[skip:], stamps[skip + 1 :], strict=False))


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
