"""BatchSizeFinder: Lightning's search for the largest batch size that fits in memory, at the start of a fit.
It changes the module's `batch_size` (or `batch_arg_name`; in its hparams or the datamodule, as Lightning
looks for it), runs a few optimizer steps at each size (see callbacks/batch_size_scaling.py), puts the
training state back after each and leaves the fit reading its loaders with the size found."""

from __future__ import annotations

from typing import TYPE_CHECKING

from callbacks.base import Callback
from callbacks.batch_size_scaling import BatchSizeSearch
from callbacks.tuning import TunerExit, attribute_holders
from trainer.core.logging import log

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class BatchSizeFinder(Callback):
    """Searches in `on_fit_start` (subclass and call `scale_batch_size` from another hook to search later);
    `optimal_batch_size` is the size found. The fit's loaders must come from the module's or datamodule's
    `train_dataloader()`, read again with each size; one process only, as in Lightning."""

    SUPPORTED_MODES = ("power", "binsearch")

    def __init__(
        self,
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> None:
        mode = mode.lower()
        if mode not in self.SUPPORTED_MODES:
            raise ValueError(
                f"mode={mode!r} is invalid; allowed: {', '.join(map(repr, self.SUPPORTED_MODES))}"
            )
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin={margin!r} is invalid; allowed: a float in [0, 1)")
        self.optimal_batch_size: int | None = init_val
        self._mode, self._steps_per_trial, self._init_val = mode, steps_per_trial, init_val
        self._max_trials, self._batch_arg_name = max_trials, batch_arg_name
        self._margin, self._max_val = margin, max_val
        self.early_exit = False  # set by a Tuner: the fit ends once the size is found

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if trainer.world_size > 1:
            raise ValueError(
                "BatchSizeFinder runs in one process only (as Lightning's); allowed: devices=1, or no BatchSizeFinder"
            )
        name = self._batch_arg_name
        if not attribute_holders(module, trainer.datamodule, name):
            raise AttributeError(
                f"Field {name} not found in `model`, `datamodule`, nor their `hparams` attributes."
            )
        if hasattr(module, name) and name in module.hparams:
            log.warning(
                f"Field `model.{name}` and `model.hparams.{name}` are mutually exclusive! `model.{name}` will be used "
                "as the initial batch size for scaling. If this is not the intended behavior, please remove either one."
            )

    def scale_batch_size(self, trainer: Trainer, module: TrainModule) -> None:
        """Search now (between steps of a fit)."""
        search = BatchSizeSearch(
            trainer, module, self._batch_arg_name, self._steps_per_trial, self._max_trials, self._max_val
        )
        self.optimal_batch_size = search.run(self._mode, self._init_val, self._margin)
        if self.early_exit:
            raise TunerExit()

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self.scale_batch_size(trainer, module)

    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._not_here(trainer, "validate")

    def on_test_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._not_here(trainer, "test")

    def on_predict_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._not_here(trainer, "predict")

    def _not_here(self, trainer: Trainer, stage: str) -> None:
        """Lightning also searches before validate/test/predict; here the batch size of those is the loader's."""
        if not trainer.fitting:
            trainer.say_once(
                f"BatchSizeFinder {stage}",
                f"BatchSizeFinder: {stage} runs with its loader's batch size (the search runs for fit only)",
            )
