"""TrainModule: the user's model and its steps, the LightningModule of this framework."""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.core.logging import console_write
from trainer.core.metrics import is_torchmetric, metric_items
from trainer.module_optimizers import ModuleOptimizers

if TYPE_CHECKING:
    from trainer.loggers import Logger
    from trainer.trainer import Trainer


class TrainModule(ModuleOptimizers, nn.Module):
    """Subclass this: build layers in `__init__` (or late in `configure_model`), define
    `training_step` and `configure_optimizers`, optionally `validation_step`/`test_step`.

    `training_step` returns a loss tensor, or a dict with "loss" and optionally "num_tokens": the number
    of items the loss is a mean over. With "num_tokens" the Trainer weights micro-batches (and data-
    parallel ranks) by it, so gradient accumulation equals one large batch even when micro-batches hold
    different token counts; without it every micro-batch weighs the same.

    `self.automatic_optimization = False` (Lightning's manual optimization): `training_step` does its own
    backward and optimizer steps, of one or several optimizers (trainer/module_optimizers.py).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A `*_step(self, batch)` without `batch_idx` (Lightning calls it without one) takes the Trainer's
        `batch_idx` and leaves it unused, so every caller passes the same arguments."""
        super().__init_subclass__(**kwargs)
        for name in STEP_METHODS:
            step = getattr(cls, name, None)  # its own, or a mixin's (a class shared with Lightning's module)
            if step is not None and not _takes_batch_idx(step):
                setattr(cls, name, _ignoring_batch_idx(step))

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self._hparams = HyperParameters()

    # ---- what the user writes -------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Once per node, before `setup`, while the other processes wait: download or write files
        (set no state here: the other processes do not run it). `prepare_data_per_node = False`: once."""

    def setup(self, stage: str) -> None:
        """Called at the start of fit/validate/test ("fit", "validate", "test"), before configure_model."""

    def teardown(self, stage: str) -> None:
        """Called at the end of fit/validate/test, also after an exception."""

    def configure_model(self) -> None:
        """Build large layers here (it runs under the strategy's init device, e.g. meta for sharding)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must define training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, Any] | None:
        raise NotImplementedError(f"{type(self).__name__} has no validation_step; define it to validate")

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, Any] | None:
        raise NotImplementedError(f"{type(self).__name__} has no test_step; define it to test")

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """What `Trainer.predict` collects for `batch` (default: `self(batch)`, as Lightning's)."""
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, Any]:
        """An optimizer, or {"optimizer": opt, "lr_scheduler": sched} to use your own scheduler."""
        raise NotImplementedError(f"{type(self).__name__} must define configure_optimizers()")

    # ---- hooks (few, named like Lightning's) ------------------------------------------------------
    def on_fit_start(self) -> None:
        """Called once the model, optimizer and checkpoint are in place, before the first step."""

    def on_fit_end(self) -> None:
        """Called after the last step."""

    # Lightning's hooks, in its order: on_train_start, then per epoch on_train_epoch_start, per step
    # on_train_batch_start -> on_before_backward -> on_after_backward -> on_before_optimizer_step ->
    # on_before_zero_grad -> on_train_batch_end, validation (on_validation_start, _epoch_start,
    # _epoch_end, _end) where due, on_train_epoch_end; on_train_end.
    def on_train_start(self) -> None:
        """Before the first training step."""

    def on_train_end(self) -> None:
        """After the last training step (before on_fit_end)."""

    def on_train_epoch_start(self) -> None:
        """At the start of each training epoch."""

    def on_train_epoch_end(self) -> None:
        """At the end of each training epoch (after its end-of-epoch validation); log here to log per epoch."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before an optimizer step's micro-batches; `batch` is the first of them."""

    def on_train_batch_end(self, outputs: dict[str, Any], batch: Any, batch_idx: int) -> None:
        """After the optimizer step; outputs["loss"] is the step's loss."""

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Before each micro-batch's backward (not under a pipeline schedule, which owns the backward)."""

    def on_after_backward(self) -> None:
        """The step's gradients are complete (accumulated, synced, normalised), not yet clipped."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's gradients are complete and not yet clipped (as in Lightning); the optimizer steps next."""

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step, before the gradients are cleared."""

    def on_validation_start(self) -> None:
        """Before a validation loop."""

    def on_validation_end(self) -> None:
        """After a validation loop."""

    def on_validation_epoch_start(self) -> None:
        """Before the first validation batch."""

    def on_validation_epoch_end(self) -> None:
        """After the last validation batch; what you log here is part of the loop's metrics."""

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Before `validation_step` of each batch (already on the device)."""

    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """After `validation_step`; `outputs` is what it returned."""

    def on_validation_model_eval(self) -> None:
        """Puts the model in eval mode as a validation loop starts; override to keep e.g. dropout on."""
        self.eval()

    def on_validation_model_train(self) -> None:
        """Puts the model back in training mode when a validation inside training ends."""
        self.train()

    def on_validation_model_zero_grad(self) -> None:
        """Frees every gradient before a validation inside training (as Lightning); override to keep them."""
        self.zero_grad()

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Before `test_step` of each batch."""

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """After `test_step`; `outputs` is what it returned."""

    def on_test_model_eval(self) -> None:
        """Puts the model in eval mode as a test loop starts."""
        self.eval()

    def on_test_model_train(self) -> None:
        """Puts the model back in training mode after a test loop that began in training mode."""
        self.train()

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Before `predict_step` of each batch."""

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """After `predict_step`; `outputs` is its prediction."""

    def on_predict_model_eval(self) -> None:
        """Puts the model in eval mode as a predict loop starts."""
        self.eval()

    def on_test_start(self) -> None:
        """Before a test loop."""

    def on_test_end(self) -> None:
        """After a test loop."""

    def on_test_epoch_start(self) -> None:
        """Before the first test batch."""

    def on_test_epoch_end(self) -> None:
        """After the last test batch; what you log here is part of the loop's metrics."""

    def on_predict_start(self) -> None:
        """Before a predict loop."""

    def on_predict_end(self) -> None:
        """After a predict loop."""

    def on_predict_epoch_start(self) -> None:
        """Before the first predict batch."""

    def on_predict_epoch_end(self) -> None:
        """After the last predict batch."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add your own entries (tensors, numbers, strings, lists, dicts) to the checkpoint."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read back what `on_save_checkpoint` added."""

    # ---- provided -------------------------------------------------------------------------------
    def log(
        self,
        name: str,
        value: float | torch.Tensor | Any,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Any = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
        add_dataloader_idx: bool = True,
    ) -> None:
        """Record a metric, as Lightning's `log` does: in training steps and their batch hooks by default
        per step (the mean over its micro-batches), elsewhere (validation/test, epoch hooks) over the
        epoch or loop; `on_step`/`on_epoch`
        choose (both: `name_step` and `name_epoch`), `reduce_fx` aggregates ("mean" weighted by
        `batch_size`, "sum", "max", "min"), `sync_dist` reduces over the data-parallel ranks,
        `logger=False` keeps it to `trainer.callback_metrics`, `prog_bar` shows it; in a loop over several
        evaluation loaders the name ends `/dataloader_idx_<i>` (unless `add_dataloader_idx=False`). A
        torchmetrics `Metric` (updated by your step) logs its batch value per step and `compute()` per epoch,
        then resets."""
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError(f"{type(self).__name__}.log({name!r}) called outside of a Trainer run")
        loader_idx = trainer.eval_loader_idx  # set in a loop over several loaders: Lightning's name then
        if add_dataloader_idx and loader_idx is not None:
            name = f"{name}/dataloader_idx_{loader_idx}"
        per_step = trainer.in_training_step
        on_step = per_step if on_step is None else on_step
        on_epoch = (not per_step) if on_epoch is None else on_epoch
        if on_epoch and not sync_dist and not is_torchmetric(value):
            warn_unsynced_once(trainer, name)
        trainer.metrics.add(
            name,
            value,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce_fx=reduce_fx,
            batch_size=batch_size,
            sync_dist=sync_dist,
            prog_bar=prog_bar,
            logger=logger,
        )

    def log_dict(self, dictionary: dict[str, float | torch.Tensor | Any], **kwargs: Any) -> None:
        """`log` each entry (of a dict or a torchmetrics `MetricCollection`) with the same options."""
        for name, value in metric_items(dictionary):
            self.log(name, value, **kwargs)

    def save_hyperparameters(self, *names: str, ignore: str | list[str] | None = None) -> None:
        """Keep the arguments of the calling `__init__` (all, or `names`, minus `ignore`) in
        `self.hparams`; the Trainer writes them to the run's logs and into every checkpoint."""
        frame = inspect.currentframe().f_back
        self._hparams.update(init_arguments(frame, type(self).__name__, names, ignore))

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | Path,
        map_location: str | torch.device | None = None,
        strict: bool = True,
        **overrides: Any,
    ) -> TrainModule:
        """A new `cls` built from the hparams its checkpoint saved (`save_hyperparameters`; `overrides`
        replace them), with the checkpoint's full weights, in this process: whole files and sharded
        checkpoints of any world size alike, verified and read without unpickling (trainer/checkpoint/weights.py).
        `map_location`: the device it ends on (default: the CPU); `strict`: every key must match."""
        from trainer.checkpoint.weights import read_checkpoint

        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise ValueError(
                f"map_location={map_location!r} is invalid; allowed: None, a device name or a torch.device"
            )
        weights, state = read_checkpoint(checkpoint_path)
        missing = [k for k in state.get("hyper_parameters_not_saved", []) if k not in overrides]
        if missing:
            raise ValueError(
                f"{cls.__name__}.load_from_checkpoint: hparam(s) {', '.join(missing)} were not plain values and "
                f"are not in the checkpoint; pass them: load_from_checkpoint(path, {missing[0]}=...)"
            )
        module = cls(**_init_arguments(cls, {**state.get("hyper_parameters", {}), **overrides}))
        if type(module).configure_model is not TrainModule.configure_model:
            module.configure_model()  # layers built late, as a fit builds them (here on the CPU)
        module.on_load_checkpoint(state.get("module", {}))
        result = module.load_state_dict(weights, strict=False)
        if strict and (result.missing_keys or result.unexpected_keys):
            raise ValueError(
                f"checkpoint '{checkpoint_path}' does not fit {cls.__name__}: missing {result.missing_keys[:3]}, "
                f"unexpected {result.unexpected_keys[:3]}; allowed: strict=False to load what fits"
            )
        return module.to(map_location) if map_location is not None else module

    @property
    def hparams(self) -> HyperParameters:
        """What `save_hyperparameters` kept: a dict that also reads as attributes (`self.hparams.lr`)."""
        return self._hparams

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer")
        return self._trainer

    @property
    def global_step(self) -> int:
        return self._trainer.state.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_rank(self) -> int:
        return self._trainer.strategy.global_rank if self._trainer is not None else 0

    @property
    def local_rank(self) -> int:
        return self._trainer.strategy.local_rank if self._trainer is not None else 0

    @property
    def device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        return self._trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on global rank zero only; to the terminal above the progress bar, as Lightning's."""
        if self.global_rank == 0:
            line = kwargs.get("sep", " ").join(map(str, args))
            console_write(line, end=kwargs.get("end", "\n"), file=kwargs.get("file") or sys.stdout)

    @property
    def logger(self) -> Logger | None:
        """The Trainer's first logger (Lightning's `self.logger`), None outside a Trainer run."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Logger]:
        """Every logger of the Trainer (Lightning's `self.loggers`), empty outside a Trainer run."""
        return self._trainer.loggers if self._trainer is not None else []

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_trainer", "_hparams"):  # never a submodule or part of the state dict
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __getstate__(self) -> dict[str, Any]:
        # a copy of the module (deepcopy, pickle) leaves its Trainer behind, as Lightning's does: the copy that
        # WeightAveraging's AveragedModel keeps must not copy the run (its strategy, loaders and process group)
        return {**self.__dict__, "_trainer": None}


# Lightning methods this Trainer does not call: a module that defines one is told once, by name
LIGHTNING_ONLY = (
    "on_before_batch_transfer",
    "on_after_batch_transfer",
    "transfer_batch_to_device",
    "configure_gradient_clipping",
    "optimizer_step",
    "optimizer_zero_grad",
    "lr_scheduler_step",
    "configure_callbacks",
    "configure_sharded_model",
)


def uncalled_lightning_methods(module: TrainModule) -> list[str]:
    """The Lightning hooks `module` defines that this Trainer never calls."""
    return [name for name in LIGHTNING_ONLY if callable(getattr(type(module), name, None))]


def init_arguments(
    frame: Any, owner: str, names: tuple[str, ...], ignore: str | list[str] | None
) -> dict[str, Any]:
    """The arguments of the `__init__` running in `frame` (all, or `names`, minus `ignore`; **kwargs under
    their own names): what `save_hyperparameters` keeps, for modules and datamodules alike."""
    code, values = frame.f_code, frame.f_locals
    count = code.co_argcount + code.co_kwonlyargcount
    arguments = list(code.co_varnames[:count])
    varkw = None
    if code.co_flags & inspect.CO_VARKEYWORDS:  # after *args, when there is one
        varkw = code.co_varnames[count + bool(code.co_flags & inspect.CO_VARARGS)]
    skipped = {"self", *([ignore] if isinstance(ignore, str) else ignore or [])}
    unknown = sorted(set(names) - set(arguments))
    if unknown:
        raise ValueError(
            f"save_hyperparameters{tuple(unknown)}: not arguments of {owner}.__init__; "
            f"allowed: {', '.join(a for a in arguments if a != 'self')}"
        )
    kept = {name: values[name] for name in arguments if name not in skipped and (not names or name in names)}
    if varkw is not None and not names:
        kept.update({k: v for k, v in values[varkw].items() if k not in skipped})
    return kept


STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def _takes_batch_idx(step: Any) -> bool:
    """Lightning's rule: `batch_idx` is passed to a step that names it, takes two positional arguments or more
    (after self), or takes *args."""
    if not inspect.isfunction(step):
        return True
    params = list(inspect.signature(step).parameters.values())[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return any(p.kind is p.VAR_POSITIONAL or p.name == "batch_idx" for p in params) or len(positional) >= 2


def _ignoring_batch_idx(step: Any) -> Any:
    @functools.wraps(step)
    def called_without_batch_idx(self: TrainModule, batch: Any, batch_idx: int, *rest: Any) -> Any:
        return step(self, batch)

    return called_without_batch_idx


def warn_unsynced_once(trainer: Trainer, name: str) -> None:
    """Lightning's warning, once per name and Trainer, for an epoch-level value logged without `sync_dist`
    under several processes: each rank aggregates its own batches, and rank 0's value is the one shown."""
    if trainer.world_size < 2:
        return
    trainer.say_once(
        f"unsynced {name}",
        f"warning: log({name!r}) aggregates over the epoch without sync_dist=True under {trainer.world_size} "
        "processes: each rank keeps its own value and rank 0's is the one logged, shown and monitored; "
        f"pass sync_dist=True to reduce it over the data-parallel ranks (said once per name)",
    )


def _init_arguments(cls: type, hparams: dict[str, Any]) -> dict[str, Any]:
    """The hparams `cls.__init__` takes (all of them when it takes **kwargs), as Lightning passes them."""
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(hparams)
    return {k: v for k, v in hparams.items() if k in {p.name for p in params}}


def not_plain(hparams: dict[str, Any]) -> list[str]:
    """The hparams whose values a checkpoint cannot hold as they are (only None, bools, numbers, strings,
    and lists/tuples/dicts of them are kept; others are written as their repr)."""
    return sorted(name for name, value in hparams.items() if not _plain(value))


def _plain(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


class HyperParameters(dict):
    """A dict whose keys also read as attributes, as Lightning's `hparams`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"hparams has no {name!r}; saved: {', '.join(self) or 'nothing'}") from None
