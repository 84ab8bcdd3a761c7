"""EarlyStopping: end the fit when a validation metric stops improving."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from trainer import flags
from trainer.logging import rank_zero_info

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class EarlyStopping(Callback):
    """After each validation, stop when `monitor` has not improved by more than `min_delta` for
    `patience` validations in a row (`mode` "min" or "max"), or at once when it is NaN/inf
    (`check_finite`). Metrics are already averaged over ranks, so every rank decides the same."""

    def __init__(
        self,
        monitor: str = "val/loss",
        patience: int = 3,
        mode: str = "min",
        min_delta: float = 0.0,
        check_finite: bool = True,
    ) -> None:
        flags.check_int("patience", patience, 1)
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} is invalid; allowed: 'min' or 'max'")
        flags.check_number("min_delta", min_delta, 0)
        self.monitor, self.patience, self.mode = monitor, patience, mode
        self.min_delta, self.check_finite = float(min_delta), check_finite
        self.best: float | None = None
        self.wait = 0
        self.stopped_at: int | None = None

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if trainer.sanity_checking:  # a few batches: not a measurement to stop on
            return
        if self.monitor not in trainer.callback_metrics:
            raise KeyError(
                f"EarlyStopping(monitor={self.monitor!r}) found no such metric; logged: "
                f"{', '.join(sorted(trainer.callback_metrics)) or 'none yet'}"
            )
        value = trainer.callback_metrics[self.monitor]
        if self.check_finite and not math.isfinite(value):
            return self._stop(trainer, f"{self.monitor} is {value}")
        sign = 1.0 if self.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self._stop(
                trainer, f"{self.monitor} did not improve on {self.best:.4g} in {self.wait} validations"
            )

    def _stop(self, trainer: Trainer, why: str) -> None:
        trainer.should_stop = True
        self.stopped_at = trainer.global_step
        rank_zero_info(f"early stopping at step {trainer.global_step}: {why}")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait = state.get("best"), state.get("wait", 0)
