"""Shared by the benchmarks: time a hand-written loop and the Trainer on the same work, alternately."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

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


def fit_timed(module: Any, loader: Any, clock: StepClock, root: str, steps: int, warmup: int) -> None:
    """The Trainer side of a benchmark: the same schedule and clipping as the hand loops, logging every 10
    steps, progress bar on, no checkpoints (the hand loops write none)."""
    from trainer import Trainer

    trainer = Trainer(
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
    trainer.fit(module, loader)


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
