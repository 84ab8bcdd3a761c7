"""Timer: stop cleanly, with a checkpoint, before a wall-clock deadline or when the job is told to go."""

from __future__ import annotations

import re
import signal
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from trainer.core.logging import log

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer

_DURATION = re.compile(r"^(\d+):(\d\d):(\d\d):(\d\d)$")


class Timer(Callback):
    """Ends a fit with a checkpoint when `duration` (seconds, a timedelta or "DD:HH:MM:SS") is nearly
    up, or when one of `signals` arrives (SLURM's `--signal=USR1@90` or SIGTERM on preemption, torchrun
    forwarding SIGTERM). "Nearly": the time left is less than the longest step so far plus the last
    checkpoint's save time, so the checkpoint is written before the deadline, not after.

    The fit then returns normally (a script exits 0) and `fit(..., ckpt_path="last")` continues
    exactly. A signal on any rank stops every rank at the same step (one all-reduce per step when
    there are several processes). The checkpoint goes through the run's ModelCheckpoint (validated,
    counted in its top k) when there is one.
    """

    def __init__(
        self,
        duration: float | str | timedelta | None = None,
        signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
    ) -> None:
        self.duration_s = _seconds(duration)
        for name in signals:
            if not isinstance(name, str) or not hasattr(signal, name):
                raise ValueError(
                    f"signals: {name!r} is not a signal name; allowed: e.g. 'SIGTERM', 'SIGUSR1'"
                )
        self.signals = tuple(signals)
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        self._start = time.monotonic()
        self._step_started = self._start
        self._longest_step = 0.0
        self._save_s = 0.0

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._start = time.monotonic()
        if stage != "fit" or threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only
        for name in self.signals:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._on_signal)

    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _on_signal(self, number: int, frame: Any) -> None:
        self.received = signal.Signals(number).name  # acted on between steps, never inside one

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        self._step_started = time.monotonic()

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        self._longest_step = max(self._longest_step, now - self._step_started)
        late = (
            self.duration_s is not None
            and trainer.is_global_zero
            and now - self._start + self._longest_step + self._save_s >= self.duration_s
        )
        stop = self.received is not None or late
        stop = trainer.strategy.any_rank(stop)
        if not stop:
            return
        if self.received:
            why = f"received {self.received}"
        else:
            why = (
                f"the {self.duration_s:.0f} s time limit is near" if late else "another rank was told to stop"
            )
        started = time.monotonic()
        trainer.save_and_stop(why)
        self._save_s = time.monotonic() - started
        if self.received and not trainer.is_global_zero:
            log.warning(f"received {self.received}: stopping with the others at step {trainer.global_step}")


def _seconds(duration: float | str | timedelta | None) -> float | None:
    if duration is None:
        return None
    if isinstance(duration, timedelta):
        seconds = duration.total_seconds()
    elif isinstance(duration, str) and (m := _DURATION.match(duration.strip())):
        days, hours, minutes, secs = (int(g) for g in m.groups())
        seconds = float(((days * 24 + hours) * 60 + minutes) * 60 + secs)
    elif isinstance(duration, (int, float)) and not isinstance(duration, bool):
        seconds = float(duration)
    else:
        raise ValueError(
            f"duration={duration!r} is invalid; allowed: seconds, a timedelta or 'DD:HH:MM:SS' (e.g. '00:03:50:00')"
        )
    if seconds <= 0:
        raise ValueError(f"duration={duration!r} is invalid; allowed: a positive length of time")
    return seconds
