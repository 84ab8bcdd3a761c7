"""TQDMProgressBar and RichProgressBar: Lightning's progress bar callbacks, as settings of the Trainer's one bar
(rank zero's bar over the fit's optimizer steps, trainer/loop/progress.py), not bars of their own."""

from __future__ import annotations

from typing import Any

from callbacks.base import Callback
from trainer import flags


class ProgressBar(Callback):
    """How the bar is drawn: `refresh_rate` 0 (or `disable()`) shows none; `leave=True` keeps each epoch's last
    state as a line above the bar."""

    def __init__(self, refresh_rate: int, leave: bool) -> None:
        self._refresh_rate = flags.check_int("refresh_rate", refresh_rate, 0)
        self._leave = bool(leave)
        self._enabled = True

    @property
    def refresh_rate(self) -> int:
        return self._refresh_rate

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.refresh_rate > 0

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        """No bar for the fits that follow (Lightning's, e.g. on ranks that print nothing)."""
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def bar_options(self) -> dict[str, Any]:
        """The keywords of the Trainer's bar (trainer/loop/progress.py ProgressBar) these settings give."""
        return {"leave_epochs": self._leave}


class TQDMProgressBar(ProgressBar):
    """The bar moves every `refresh_rate` optimizer steps (and at the last); `process_position` is its line
    (tqdm's `position`, for several bars in one terminal); `leave=True` keeps a line per epoch."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate, leave)
        self._process_position = flags.check_int("process_position", process_position, 0)

    @property
    def process_position(self) -> int:
        return self._process_position

    def bar_options(self) -> dict[str, Any]:
        return {
            **super().bar_options(),
            "every_n_steps": self.refresh_rate,
            "position": self._process_position,
        }


class RichProgressBar(ProgressBar):
    """The bar redraws at most `refresh_rate` times a second (Lightning's rich bar counts per second, too);
    `leave=True` keeps a line per epoch. Drawn by the Trainer's tqdm bar: rich's theme and console are not
    taken."""

    def __init__(self, refresh_rate: int = 100, leave: bool = False) -> None:
        super().__init__(refresh_rate, leave)

    def bar_options(self) -> dict[str, Any]:
        return {**super().bar_options(), "mininterval": 1.0 / self.refresh_rate}


def check_progress_bars(callbacks: list[Callback], enable_progress_bar: bool) -> None:
    """Lightning's rules: at most one progress bar callback, and none with `enable_progress_bar=False`."""
    bars = [cb for cb in callbacks if isinstance(cb, ProgressBar)]
    if len(bars) > 1:
        names = ", ".join(type(cb).__name__ for cb in bars)
        raise ValueError(f"callbacks hold {len(bars)} progress bars ({names}); allowed: one")
    if bars and not enable_progress_bar:
        raise ValueError(
            f"Trainer(enable_progress_bar=False) with {type(bars[0]).__name__} in callbacks; allowed: one of the two"
        )
