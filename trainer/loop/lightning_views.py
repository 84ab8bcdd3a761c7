"""The Trainer's read-only views under Lightning's names (`trainer.logger`, `optimizers`,
`estimated_stepping_batches`, ...), which modules and callbacks written for Lightning read."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from callbacks.checkpoint import ModelCheckpoint
from callbacks.progress_bars import ProgressBar
from trainer.loop.manual_step import ManualFitLoop

if TYPE_CHECKING:
    from trainer.loggers import Logger
    from trainer.loop.optim_config import SchedulerConfig


class LightningViews:
    """Views of a Trainer's state (its loggers, strategy, optimizer, fit loop and callbacks)."""

    @property
    def logger(self) -> Logger | None:
        """The first logger (Lightning's `trainer.logger`); `loggers` holds them all, the JSONL log last."""
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str | None:
        """Lightning's: the first logger's `log_dir` (its `save_dir` when it has none), the same on every
        rank once a fit has started."""
        logger = self.logger
        return logger.log_dir or logger.save_dir if logger is not None else str(self.default_root_dir)

    @property
    def callback_metrics(self) -> dict[str, float]:
        """Every metric's latest value (Lightning's), for callbacks: what the loggers got, `logger=False`
        values, and each training step's per-step values, also between the rows `log_every_n_steps` writes."""
        self._unread_steps.settle(self._callback_metrics, self._logged_metrics)
        return self._callback_metrics

    @property
    def logged_metrics(self) -> dict[str, float]:
        """What was logged (Lightning's): the loggers' values, and each training step's per-step values."""
        self._unread_steps.settle(self._callback_metrics, self._logged_metrics)
        return self._logged_metrics

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def precision(self) -> str:
        """Lightning's name of the run's precision: "32-true", "16-mixed", "bf16-mixed" or "bf16-true"."""
        name = self.strategy.precision.name
        return "32-true" if name == "32" else name

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Lightning's list of the fit's optimizers (one, or under manual optimization as many as
        `configure_optimizers` returned; empty before it ran)."""
        manual = self.manual_optimization
        if manual is not None:
            return list(manual.optimizers)
        return [] if self.optimizer is None else [self.optimizer]

    @property
    def lr_scheduler_configs(self) -> list[SchedulerConfig]:
        """The schedulers `configure_optimizers` returned with their settings (`.scheduler`, `.interval`,
        `.frequency`, `.monitor`, ...), as Lightning's list; empty without one (the Trainer's own schedule)."""
        manual = self.manual_optimization
        if manual is not None:
            return list(manual.lr_scheduler_configs)
        return [] if self._scheduler_config is None else [self._scheduler_config]

    @property
    def manual_optimization(self) -> ManualFitLoop | None:
        """The running (or last) fit's loop when its module optimizes manually (`automatic_optimization =
        False`): what the module's `optimizers()`, `manual_backward` and `clip_gradients` reach; else None."""
        loop = self._fit_loop
        return loop if isinstance(loop, ManualFitLoop) else None

    @property
    def num_training_batches(self) -> int | float:
        """Train batches (micro-batches) per epoch on this rank, after `limit_train_batches`; inf when the
        loader has no len() or before a fit has its loader, as in Lightning."""
        length = None if self._fit_loop is None else self._fit_loop.train_batches.epoch_length()
        return math.inf if length is None else length

    @property
    def estimated_stepping_batches(self) -> int | float:
        """Optimizer steps the fit will take (Lightning's: from max_steps/max_epochs, the loader's length on
        this rank, `limit_train_batches` and accumulation); known from `configure_optimizers` on, e.g. for
        OneCycleLR's `total_steps`. inf when neither max_steps nor the loader's length bounds it."""
        if self._fit_loop is None:
            raise RuntimeError(
                "estimated_stepping_batches needs the fit's train loader; allowed: read it from "
                "configure_optimizers (or later in a fit)"
            )
        total = self._fit_loop.total_steps()
        return math.inf if total is None else total

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The run's ModelCheckpoint (callbacks that save, e.g. on a signal, go through it), or None."""
        return self.checkpoint_manager.saver

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        """Every ModelCheckpoint among the callbacks, in order (Lightning's list)."""
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def progress_bar_callback(self) -> ProgressBar | None:
        """The TQDMProgressBar or RichProgressBar among the callbacks (it sets how the Trainer's bar is drawn),
        or None: the bar as it is by default."""
        return next((cb for cb in self.callbacks if isinstance(cb, ProgressBar)), None)

    @property
    def train_dataloader(self) -> Any:
        """The fit's train loader, this rank's share (Lightning's `trainer.train_dataloader`); None outside a fit."""
        return None if self._fit_loop is None else self._fit_loop.train_batches.loader
