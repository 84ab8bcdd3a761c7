"""The progress bar on rank zero: step, loss, lr and speed."""

from __future__ import annotations

import sys

from tqdm import tqdm


class ProgressBar:
    """A tqdm bar over optimizer steps, updated each step; its text is refreshed on logged steps only
    (reading the loss every step would force a device sync)."""

    def __init__(self, total: int | None, initial: int, desc: str = "train") -> None:
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            dynamic_ncols=True,
            mininterval=0.5 if sys.stderr.isatty() else 10.0,
            file=sys.stderr,
        )

    def update(self, steps: int = 1) -> None:
        self._bar.update(steps)

    def reset(self, step: int) -> None:
        """Move the bar to `step` (after a rollback)."""
        self._bar.n = step
        self._bar.refresh()

    def show(self, metrics: dict[str, float]) -> None:
        """The metrics after the bar, drawn at its next refresh: the text tqdm's `set_postfix` would make,
        without its per-call work (an OrderedDict, type checks)."""
        self._bar.postfix = ", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())

    def write(self, line: str) -> None:
        """Print a line above the bar (e.g. a validation result)."""
        self._bar.write(line, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()


def _fmt(value: float) -> str:
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.2e}"
    return f"{value:.4g}"
