"""PhaseTimes: where a fit's training time went, phase by phase, in one line at its end (what Lightning's
`profiler="simple"` gives: the time of each action, without a trace)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from callbacks.base import Callback
from trainer.core.logging import rank_zero_info
from trainer.core.timing import PHASES

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class PhaseTimes(Callback):
    """From `on_train_start` to `on_train_end`, the seconds this rank's steps spent in each phase of the
    Trainer's clock (data, forward, backward, optimizer; see trainer.core.timing), kept in `seconds`; rank
    zero ends the fit with one line: each phase's total, its mean per optimizer step and its share of the
    training time. The loop's clock times the phases while a reader watches it: two clock reads a phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}  # phase -> seconds of the last fit
        self.steps = 0  # optimizer steps of the last fit
        self._start: tuple[dict[str, float], int, float] | None = None

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        trainer.clock.watch(self)
        self._start = (trainer.clock.snapshot(), trainer.global_step, time.perf_counter())

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        before, first_step, began = self._start
        now, wall = trainer.clock.snapshot(), max(time.perf_counter() - began, 1e-9)
        trainer.clock.unwatch(self)
        self.seconds = {phase: now[phase] - before[phase] for phase in PHASES}
        self.steps = trainer.global_step - first_step
        per_step = 1e3 / max(self.steps, 1)
        parts = ", ".join(
            f"{phase} {s:.2f} s ({s * per_step:.1f} ms/step, {100 * s / wall:.0f}%)"
            for phase, s in self.seconds.items()
        )
        rank_zero_info(f"PhaseTimes: {self.steps} steps in {wall:.2f} s: {parts}")
