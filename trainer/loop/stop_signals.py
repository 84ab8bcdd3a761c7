"""Ctrl-C and SIGTERM during a fit: the first one lets the step in flight finish, then every rank saves a
resumable checkpoint and the process exits with 128 + the signal's number (130, 143: what shells, SLURM and
torchrun read as "stopped by a signal"); a second Ctrl-C aborts at once. The ranks agree on the step to stop
at through one small all-reduce per step on the CPU, started after a step and read after the next, so it
overlaps a whole step and never waits on the device."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only

from trainer.core.logging import console_write

NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class StoppedBySignal(SystemExit):
    """A fit a signal stopped after its checkpoint: the process exits with 128 + the signal's number and
    no traceback (a SystemExit), after the code that called `fit` is left."""

    def __init__(self, number: int) -> None:
        super().__init__(128 + number)
        self.signal = number


class StopSignals:
    """SIGINT and SIGTERM handlers for one fit (installed in the main thread only: Python delivers signals
    there); `agreed()` says, every rank alike, whether the fit stops now, and for which signal."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal's number on this rank
        self._previous: dict[int, Any] = {}
        self._group: Any = None  # a gloo group: the agreement never waits on a device
        self._flag: torch.Tensor | None = None
        self._work: Any = None  # the all-reduce started after the previous step

    def install(self) -> None:
        """Take SIGINT and SIGTERM where Python's defaults still hold them: a handler of the user's, or of
        a callback such as Timer (whose SIGTERM stop exits 0), keeps its signal, as in Lightning."""
        if threading.current_thread() is not threading.main_thread():
            return
        for number in NAMES:
            if signal.getsignal(number) in (signal.SIG_DFL, signal.default_int_handler):
                self._previous[number] = signal.signal(number, self._on_signal)

    def restore(self) -> None:
        """The handlers from before the fit; an agreement still in flight is dropped (the fit failed)."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        if self.received is not None:
            if number == signal.SIGINT:  # the second Ctrl-C: now, without a checkpoint
                raise KeyboardInterrupt
            return  # a scheduler's repeated SIGTERM: the stop is already under way
        self.received = number
        _announce(
            f"{NAMES[number]}: finishing the step in flight, then saving a checkpoint"
            + (" (Ctrl-C again to abort at once, without one)" if number == signal.SIGINT else "")
        )

    def agreed(self, world_size: int) -> int | None:
        """The signal every rank stops for now, or None. One process: this one's. Several: the largest of
        the numbers the ranks had received when the previous call started its all-reduce (every rank calls,
        at the same points of the loop)."""
        if world_size == 1:
            return self.received
        found = None
        if self._work is not None:
            self._work.wait()
            found = int(self._flag.item()) or None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        self._flag = torch.tensor([self.received or 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return found

    def finish(self) -> None:
        """At the end of a fit every rank completed: the last all-reduce is awaited, then the group goes."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


@rank_zero_only
def _announce(line: str) -> None:
    console_write(f"[trainer] {line}")
