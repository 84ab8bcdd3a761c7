"""LossWindow: the last few good losses of a run, which spike checks compare a step's loss with."""

from __future__ import annotations

import math
import statistics
from collections import deque


class LossWindow:
    """The last `size` losses added (NaNGuard reads their median, SpikeDetection their mean); a checkpoint
    keeps them as a plain list (`state_dict`)."""

    def __init__(self, size: int) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, loss: float) -> None:
        self._values.append(loss)

    def __len__(self) -> int:
        return len(self._values)

    def median(self) -> float:
        return statistics.median(self._values)

    def mean(self) -> float:
        """The mean, NaN while empty (nothing to compare with: no loss is a spike)."""
        return math.fsum(self._values) / len(self._values) if self._values else math.nan

    def state_dict(self) -> list[float]:
        return list(self._values)

    def load_state_dict(self, values: list[float]) -> None:
        self._values.clear()
        self._values.extend(values)
