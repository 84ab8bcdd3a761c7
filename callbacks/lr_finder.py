"""LearningRateFinder: Lightning's learning-rate range test at the start of a fit. `num_training_steps` steps
of the fit raise the LR from `min_lr` to `max_lr` (exponentially or linearly), recording the smoothed loss,
stopping early when it diverges; then the model, optimizer, step counters, RNG and callbacks' state are put
back (`Trainer.run_trial`) and, with `update_attr`, the module's `lr`/`learning_rate` (or `attr_name`) and
the optimizer take the suggestion, so the fit trains from there with it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from callbacks.base import Callback
from callbacks.lr_sweep import MODES, LRFinder, SweepRecorder
from callbacks.tuning import TunerExit, attribute_holders, set_attribute
from trainer.core.logging import log

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class LearningRateFinder(Callback):
    """Runs the range test in `on_fit_start` (subclass and call `lr_find` from another hook to run it later,
    e.g. at chosen epochs); `optimal_lr` holds the `LRFinder` with the results and `suggestion()`."""

    SUPPORTED_MODES = MODES

    def __init__(
        self,
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training_steps: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> None:
        mode = mode.lower()
        if mode not in self.SUPPORTED_MODES:
            raise ValueError(f"mode={mode!r} is invalid; allowed: {', '.join(map(repr, MODES))}")
        self._min_lr, self._max_lr, self._num_training_steps = min_lr, max_lr, num_training_steps
        self._mode, self._early_stop_threshold = mode, early_stop_threshold
        self._update_attr, self._attr_name = update_attr, attr_name
        self.early_exit = False  # set by a Tuner: the fit ends once the test is done
        self.optimal_lr: LRFinder | None = None

    def lr_find(self, trainer: Trainer, module: TrainModule) -> None:
        """Run the range test now (every rank, between steps)."""
        self.optimal_lr = lr_find(
            trainer,
            module,
            min_lr=self._min_lr,
            max_lr=self._max_lr,
            num_training=self._num_training_steps,
            mode=self._mode,
            early_stop_threshold=self._early_stop_threshold,
            update_attr=self._update_attr,
            attr_name=self._attr_name,
        )
        if self.early_exit:
            raise TunerExit()

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self.lr_find(trainer, module)


def lr_find(
    trainer: Trainer,
    module: TrainModule,
    min_lr: float = 1e-8,
    max_lr: float = 1,
    num_training: int = 100,
    mode: str = "exponential",
    early_stop_threshold: float | None = 4.0,
    update_attr: bool = False,
    attr_name: str = "",
) -> LRFinder:
    """The range test inside the running fit (Lightning's `_lr_find`); the training state is as before it,
    but for the suggested LR when `update_attr`."""
    if update_attr:
        attr_name = lr_attribute(module, trainer.datamodule, attr_name)
    finder = LRFinder(mode, min_lr, max_lr, num_training)
    recorder = SweepRecorder(early_stop_threshold)
    trainer.run_trial(num_training, [recorder], finder.scheduler)
    if len(recorder.losses) < num_training:
        log.info(f"LR finder stopped early after {len(recorder.losses)} steps due to diverging loss.")
    finder.results = trainer.strategy.broadcast_object({"lr": recorder.lrs, "loss": recorder.losses})
    lr = finder.suggestion() if update_attr else None
    if lr is not None:
        # after the state was put back, so that the fit goes on with it (Lightning 2.6 sets it there too)
        set_attribute(module, trainer.datamodule, attr_name, lr)
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        if not trainer.lr_scheduler_configs:
            # the Trainer's own schedule scales each group's base LR: it starts from the suggestion now
            trainer.lr_scheduler.base_lrs = [lr] * len(trainer.optimizer.param_groups)
        log.info(f"Learning rate set to {lr}")
    return finder


def lr_attribute(module: TrainModule, datamodule: object, attr_name: str) -> str:
    """The name the LR is kept under: `attr_name`, else `lr` or `learning_rate` (module, hparams or
    datamodule); a one-line error when there is none."""
    if attr_name:
        if not attribute_holders(module, datamodule, attr_name):
            raise AttributeError(
                f"The attribute name for the learning rate was set to {attr_name}, but could not find this as a "
                "field in `model` or `model.hparams`."
            )
        return attr_name
    for name in ("lr", "learning_rate"):
        if attribute_holders(module, datamodule, name):
            return name
    raise AttributeError(
        "When using the learning rate finder, either `model` or `model.hparams` should have one of these fields: "
        "('lr', 'learning_rate'). If your model has a different name for the learning rate, set it with "
        "`.lr_find(attr_name=...)`."
    )
