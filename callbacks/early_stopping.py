"""EarlyStopping: end the fit when a monitored metric stops improving, with Lightning's arguments."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from trainer import flags
from trainer.core.logging import rank_zero_info

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by more than `min_delta` for `patience` checks in a row (`mode`
    "min" or "max"); at once when it is NaN/inf (`check_finite`), beyond `stopping_threshold` (good enough)
    or beyond `divergence_threshold` (hopeless), as Lightning checks them. A check runs at the end of each
    training epoch when validation runs there every epoch (or `check_on_train_epoch_end=True`), else after
    each validation of the fit. `strict=False` skips a check whose metric is missing; `verbose` reports
    each improvement. Metrics are agreed over ranks first, so every rank decides the same."""

    def __init__(
        self,
        monitor: str = "val/loss",
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
    ) -> None:
        # 0: stop at the first check without improvement, as Lightning allows
        flags.check_int("patience", patience, 0)
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} is invalid; allowed: 'min' or 'max'")
        flags.check_number("min_delta", min_delta, 0)
        for name, value in (
            ("stopping_threshold", stopping_threshold),
            ("divergence_threshold", divergence_threshold),
        ):
            flags.check_number(name, value, -math.inf, allow_none=True)
        self.monitor, self.patience, self.mode, self.verbose, self.strict = (
            monitor,
            patience,
            mode,
            verbose,
            strict,
        )
        self.min_delta, self.check_finite = float(min_delta), check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self._at_epoch_end = bool(check_on_train_epoch_end)  # resolved in setup when None
        self.best: float | None = None
        self.wait_count = 0
        self.stopped_epoch = 0  # Lightning's: the epoch in which the fit was stopped (0: not stopped)
        self.stopped_at: int | None = None  # the step

    @property
    def best_score(self) -> torch.Tensor:
        """Lightning's: the best value so far as a tensor (inf, or -inf for "max", before the first check)."""
        start = math.inf if self.mode == "min" else -math.inf
        return torch.tensor(start if self.best is None else self.best)

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if self.check_on_train_epoch_end is None:  # Lightning's rule: validation at every epoch's end
            self._at_epoch_end = (
                trainer.val_check_interval in (None, 1.0) and trainer.check_val_every_n_epoch == 1
            )

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._at_epoch_end:
            self._check(trainer)

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        # a few batches of the sanity check, or a validate() outside a fit: not a measurement to stop on
        if not self._at_epoch_end and not trainer.sanity_checking and trainer.fitting:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        if self.monitor not in trainer.callback_metrics:
            if not self.strict:
                if self.verbose:
                    rank_zero_info(f"EarlyStopping: {self.monitor!r} was not logged; this check is skipped")
                return
            raise KeyError(
                f"EarlyStopping(monitor={self.monitor!r}) found no such metric; logged: "
                f"{', '.join(sorted(trainer.callback_metrics)) or 'none yet'}"
            )
        value = float(trainer.callback_metrics[self.monitor])
        sign = 1.0 if self.mode == "min" else -1.0  # "better" is smaller: compare sign * values
        if self.check_finite and not math.isfinite(value):
            return self._stop(trainer, f"{self.monitor} is {value}")
        if self.stopping_threshold is not None and sign * value < sign * self.stopping_threshold:
            return self._stop(
                trainer, f"{self.monitor} = {value:.4g} reached stopping_threshold {self.stopping_threshold}"
            )
        if self.divergence_threshold is not None and sign * value > sign * self.divergence_threshold:
            return self._stop(
                trainer,
                f"{self.monitor} = {value:.4g} beyond divergence_threshold {self.divergence_threshold}",
            )
        if self.best is None or sign * (self.best - value) > self.min_delta:
            if self.verbose:
                rank_zero_info(f"EarlyStopping: {self.monitor} improved to {value:.4g}")
            self.best, self.wait_count = value, 0
            return
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self._stop(
                trainer, f"{self.monitor} did not improve on {self.best:.4g} in {self.wait_count} checks"
            )

    def _stop(self, trainer: Trainer, why: str) -> None:
        trainer.should_stop = True
        self.stopped_at, self.stopped_epoch = trainer.global_step, trainer.current_epoch
        rank_zero_info(f"early stopping at step {trainer.global_step}: {why}")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait_count, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait_count = state.get("best"), state.get("wait", 0)
        self.stopped_epoch = state.get("stopped_epoch", 0)
