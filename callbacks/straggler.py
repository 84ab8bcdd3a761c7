"""StragglerDetector: name the ranks whose own work is slower than the others', every N steps."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from trainer import flags
from trainer.core.logging import log

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class StragglerDetector(Callback):
    """Every `every_n_steps` steps, gather each rank's time in the phases where it waits for no other
    rank (the strategy's `local_phases`: data loading, and the forward and/or optimizer step where
    they do not communicate) over the last `window` steps. A rank above `factor` x the median is named
    in a warning and passed to every callback's `on_straggler`, because the slowest rank sets the step
    time of all. Whole-step times cannot show this: collectives make every rank wait for the slowest.

    On CUDA the window's phase boundaries synchronize the device, so the times are device times.
    `min_gap_s` ignores differences too small to matter (scheduler noise on tiny steps).
    """

    def __init__(
        self, every_n_steps: int = 100, window: int = 10, factor: float = 1.5, min_gap_s: float = 0.0
    ) -> None:
        flags.check_int("every_n_steps", every_n_steps, 1)
        flags.check_int("window", window, 1)
        if window > every_n_steps:
            raise ValueError(f"window={window} is invalid; allowed: at most every_n_steps={every_n_steps}")
        flags.check_number("factor", factor, 1, strict=True)
        flags.check_number("min_gap_s", min_gap_s, 0)
        self.every_n_steps, self.window, self.factor, self.min_gap_s = (
            every_n_steps,
            window,
            factor,
            min_gap_s,
        )
        self.last: dict[int, float] = {}  # the latest verdict: rank -> time / median
        self._start: dict[str, float] | None = None

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        trainer.clock.watch(self)
        self._maybe_start_window(trainer)

    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        trainer.clock.unwatch(self)

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.every_n_steps == 0 and self._start is not None:
            self._check(trainer)
        self._maybe_start_window(trainer)

    def _maybe_start_window(self, trainer: Trainer) -> None:
        """The measured window is the `window` steps before each multiple of `every_n_steps`."""
        if (trainer.global_step + self.window) % self.every_n_steps == 0:
            self._start = trainer.clock.snapshot()
            if trainer.strategy.root_device.type == "cuda":
                trainer.clock.request_sync(self, torch.cuda.synchronize)

    def _check(self, trainer: Trainer) -> None:
        step, clock = trainer.global_step, trainer.clock
        clock.release_sync(self)
        now = clock.snapshot()
        mine = sum(now[p] - self._start[p] for p in trainer.strategy.local_phases)
        self._start = None
        times = trainer.strategy.all_gather_object(mine, group="world")
        median = statistics.median(times)
        self.last = {
            rank: t / median
            for rank, t in enumerate(times)
            if t > self.factor * median and t - median > self.min_gap_s and median > 0
        }
        trainer.log_metrics({"straggler/slowest_vs_median": max(times) / median if median > 0 else 1.0})
        if not self.last:
            return
        if trainer.is_global_zero:
            named = ", ".join(f"rank {r} ({times[r]:.3f} s, {ratio:.1f}x)" for r, ratio in self.last.items())
            phases = "/".join(trainer.strategy.local_phases)
            log.warning(
                f"straggler: {named} vs the median {median:.3f} s of {phases} time over steps "
                f"{step - self.window + 1}-{step}; the slowest rank sets every rank's step time"
            )
        trainer.call_callbacks("on_straggler", self.last)
