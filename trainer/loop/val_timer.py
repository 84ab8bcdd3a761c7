"""`val_check_interval` as a time (Lightning 2.6's "DD:HH:MM:SS", timedelta or dict): a validation is due after
a step once `time.monotonic()` has moved that far since the last validation ended, or since training started
(as Lightning's `_last_val_time`); no validation at epoch ends then. One clock read per step, only when set.
Several processes agree on the step as for `max_time` (trainer/loop/time_limit.py: the slowest rank's clock,
compared at agreed steps only), so that every rank validates after the same step."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainer.loop.time_limit import TimeLimit

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class ValTimer:
    """When the next time-based validation is due; `every_n_epochs` (check_val_every_n_epoch) picks the epochs
    it may fall in, as Lightning's."""

    def __init__(
        self,
        seconds: float,
        agreed: bool,
        slowest: Callable[[float], float],
        every_n_epochs: int | None = None,
    ) -> None:
        self.seconds, self.agreed, self.slowest, self.every_n_epochs = (
            seconds,
            agreed,
            slowest,
            every_n_epochs,
        )
        self.since = 0.0
        self.limit = TimeLimit(seconds, 0, agreed)

    @classmethod
    def for_fit(cls, trainer: Trainer, slowest: Callable[[float], float]) -> ValTimer | None:
        """The fit's timer, started now, when its `val_check_interval` is a time; else None."""
        interval = trainer.val_check_interval
        if not isinstance(interval, datetime.timedelta):
            return None
        agreed = trainer.strategy.world_size > 1
        timer = cls(interval.total_seconds(), agreed, slowest, trainer.check_val_every_n_epoch)
        timer.restart(trainer.global_step)
        return timer

    def checks_epoch(self, epoch: int) -> bool:
        """Whether epoch `epoch` (0-based) may hold a validation."""
        return self.every_n_epochs is None or (epoch + 1) % self.every_n_epochs == 0

    def restart(self, step: int) -> None:
        """The interval counts from now (training starts, its loader is read again, a validation ended)."""
        self.since = time.monotonic()
        self.limit = TimeLimit(self.seconds, step, self.agreed)

    def due(self, step: int) -> bool:
        """Whether a validation follows `step` (every rank calls it after each step)."""
        return self.limit.reached(step, time.monotonic() - self.since, self.slowest)
