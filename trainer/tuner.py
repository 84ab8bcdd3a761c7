"""Tuner: Lightning's `lightning.pytorch.tuner.Tuner` (`from trainer.tuner import Tuner`). Each method runs a fit
of `model` with the tuner's callback first among the Trainer's callbacks; the callback finds its value in
`on_fit_start`, puts the training state back and ends that fit before its first step (`TunerExit`); the
method returns the value, and the model keeps it (`lr`, `batch_size`) for the `trainer.fit` that follows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from callbacks.batch_size_finder import BatchSizeFinder
from callbacks.lr_finder import LearningRateFinder
from callbacks.lr_sweep import LRFinder
from callbacks.tuning import TunerExit

if TYPE_CHECKING:
    from callbacks.base import Callback
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class Tuner:
    """Tunes a model's learning rate (`lr_find`) or batch size (`scale_batch_size`) with a Trainer."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def scale_batch_size(
        self,
        model: TrainModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        method: str = "fit",
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> int | None:
        """The largest batch size whose trials of `steps_per_trial` steps did not run out of memory ("power":
        doubling; "binsearch": doubling, then bisecting, less `margin`), set on `model` (or its hparams, or the
        datamodule) as `batch_arg_name`. The loaders must come from the model's or datamodule's
        `train_dataloader()`, read again at each size."""
        _check_method(method, dataloaders)
        _check_not_configured(self._trainer, BatchSizeFinder)
        finder = BatchSizeFinder(mode, steps_per_trial, init_val, max_trials, batch_arg_name, margin, max_val)
        self._fit_with(finder, model, train_dataloaders, val_dataloaders, datamodule)
        return finder.optimal_batch_size

    def lr_find(
        self,
        model: TrainModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        method: str = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> LRFinder | None:
        """A learning-rate range test of `num_training` steps from `min_lr` to `max_lr` (see
        callbacks/lr_finder.py); the results with `suggestion()` and `plot()`. With `update_attr` the model's
        `lr`/`learning_rate` (or `attr_name`) is set to the suggestion."""
        _check_method(method, dataloaders)
        _check_not_configured(self._trainer, LearningRateFinder)
        finder = LearningRateFinder(
            min_lr, max_lr, num_training, mode, early_stop_threshold, update_attr, attr_name
        )
        self._fit_with(finder, model, train_dataloaders, val_dataloaders, datamodule)
        return finder.optimal_lr

    def _fit_with(self, finder: Callback, model: TrainModule, train: Any, val: Any, datamodule: Any) -> None:
        """A fit of `model` with `finder` first among the callbacks, which ends it once its value is found."""
        trainer = self._trainer
        finder.early_exit = True
        trainer.callbacks = [finder, *trainer.callbacks]
        try:
            trainer.fit(model, train, val, datamodule)
        except TunerExit:
            pass
        finally:
            trainer.callbacks = [cb for cb in trainer.callbacks if cb is not finder]


def _check_method(method: str, dataloaders: Any) -> None:
    """Lightning's argument checks; the search runs for fit only here (Lightning also for validate/test/predict)."""
    if method != "fit":
        raise ValueError(
            f"method={method!r} is not supported here; allowed: 'fit' (the tuner searches with training steps)"
        )
    if dataloaders is not None:
        raise ValueError(
            "In tuner with method='fit', `dataloaders` argument should be None, please consider setting "
            "`train_dataloaders` and `val_dataloaders` instead."
        )


def _check_not_configured(trainer: Trainer, kind: type) -> None:
    if any(isinstance(cb, kind) for cb in trainer.callbacks):
        raise ValueError(
            f"Trainer is already configured with a `{kind.__name__}` callback. Please remove it if you want to use "
            "the Tuner."
        )
