"""The progress bar on rank zero: step, loss, lr and speed."""

from __future__ import annotations

import sys
from time import perf_counter

from tqdm import tqdm


class ProgressBar:
    """A tqdm bar over optimizer steps, moved every `every_n_steps` steps (and at the last) once its
    `mininterval` has passed since it last moved (tqdm would not redraw sooner, and a call into it every step
    costs a small step ~1%); its text is refreshed on logged steps only (reading the loss every step would
    force a device sync). `position`, `mininterval` (seconds between redraws) and `leave_epochs` (a line per
    epoch kept above the bar) come from a progress bar callback (callbacks/progress_bars.py) when there is one."""

    def __init__(
        self,
        total: int | None,
        initial: int,
        desc: str = "train",
        *,
        every_n_steps: int = 1,
        position: int = 0,
        mininterval: float | None = None,
        leave_epochs: bool = False,
    ) -> None:
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            dynamic_ncols=True,
            mininterval=(0.5 if sys.stderr.isatty() else 10.0) if mininterval is None else mininterval,
            position=position,
            file=sys.stderr,
        )
        self._every, self._leave_epochs = every_n_steps, leave_epochs
        self._pending = 0  # steps done that the bar does not show yet
        self._due = 0.0  # perf_counter() from which the bar may move again
        self._shown: dict[str, float] = {}
        self._kept: dict[str, float] = {}
        self._stale = False  # `_shown` changed since the text was made

    def update(self, steps: int = 1) -> None:
        self._pending += steps
        done = self._bar.n + self._pending
        if done == self._bar.total or (done % self._every == 0 and perf_counter() >= self._due):
            self._flush()

    def end_epoch(self) -> None:
        """An epoch ended: with `leave_epochs`, its last state stays as a line above the bar."""
        if self._leave_epochs:
            self._flush()
            self._bar.write(str(self._bar), file=sys.stderr)

    def reset(self, step: int) -> None:
        """Move the bar to `step` (after a rollback)."""
        self._pending = 0
        self._bar.n = step
        self._bar.refresh()

    def show(self, metrics: dict[str, float]) -> None:
        """The step's metrics after the bar (then the kept ones), drawn when the bar next moves: their text
        is made then (`_postfix`), once per redraw rather than once per logged step."""
        self._shown, self._stale = metrics, True

    def _postfix(self) -> None:
        """The text tqdm's `set_postfix` would make, without its per-call work (an OrderedDict, type checks)."""
        self._bar.postfix = ", ".join(f"{k}={fmt(v)}" for k, v in {**self._shown, **self._kept}.items())
        self._stale = False

    def keep(self, metrics: dict[str, float]) -> None:
        """Values that stay after the step's metrics until replaced (a validation's `prog_bar=True` ones,
        as Lightning's bar keeps them), drawn now."""
        self._kept.update(metrics)
        self._postfix()
        self._bar.refresh()

    def write(self, line: str) -> None:
        """Print a line above the bar (e.g. a validation result)."""
        self._bar.write(line, file=sys.stderr)

    def close(self) -> None:
        self._flush()
        self._bar.close()

    def _flush(self) -> None:
        if self._stale:
            self._postfix()
        if self._pending:
            self._bar.update(self._pending)
            self._pending = 0
            self._due = perf_counter() + self._bar.mininterval


def fmt(value: float) -> str:
    """A metric as the console shows it: 4 significant digits, exponent notation when tiny or huge."""
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.2e}"
    return f"{value:.4g}"
