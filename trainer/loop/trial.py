"""The tuner's trial steps inside a fit. The LR finder's sweep and the batch size finder's trials run the fit's
own optimizer steps on a loop of their own, with only their callbacks, no loggers and (the sweep) their own LR
scheduler, as Lightning reruns its fit loop with those swapped; then whatever the steps disturbed is put back,
as Lightning puts it back from a temporary checkpoint: model weights and buffers, optimizer state, step
counters, RNG streams, LR schedule, data position, precision, strategy and callbacks' state. The copy is kept
in this process's memory (on the CPU), not in a file."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainer.checkpoint.manager import put_back_weights, stash_weights
from trainer.core.metrics import UnreadStepValues
from trainer.core.tree import apply_to_tensors
from trainer.datamodule import loaders_from
from trainer.loop.epochs import EpochBatches
from trainer.loop.fit_loop import FitLoop
from trainer.loop.stages import fit_loader

if TYPE_CHECKING:
    from callbacks.base import Callback
    from trainer.trainer import Trainer

# the training state's parts (trainer/loop/training_state.py) that trial steps move, beside model and optimizer
KEPT_PARTS = ("loop", "rng", "scheduler", "precision", "data", "strategy", "callbacks", "module")


class TrialLoop(FitLoop):
    """Up to `steps` optimizer steps of the running fit `fit`, from where it is: they end early at max_epochs or
    when a callback sets `should_stop` (the LR finder's divergence), never on max_steps (Lightning sets it to
    the trial's end), and run no validation, checkpoint or progress bar."""

    def __init__(self, fit: FitLoop, steps: int) -> None:
        super().__init__(fit.trainer, fit.module, fit.train_batches.loader, None)
        self.last_step = fit.trainer.global_step + steps

    @property
    def done(self) -> bool:
        trainer, s = self.trainer, self.trainer.state
        return (
            trainer.should_stop
            or s.global_step >= self.last_step
            or (trainer.max_epochs is not None and s.epoch >= trainer.max_epochs)
        )

    def poll_stops(self) -> None:
        """A trial is a few steps: a signal, max_time or the strategy's stop reason waits for the fit's next step."""

    def run_steps(self) -> None:
        self._train()


class KeptState:
    """What trial steps change, copied when made (this rank's part, on the CPU) and put back by `restore`."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.weights = stash_weights(trainer.module)
        self.optimizer = apply_to_tensors(trainer.optimizer.state_dict(), _cpu_copy)
        self.parts = copy.deepcopy(trainer.training_state.capture(KEPT_PARTS, local=True))
        self.metrics = dict(trainer.callback_metrics), dict(trainer.logged_metrics)

    def restore(self) -> None:
        trainer = self.trainer
        # a trial that failed inside a step (out of memory) leaves its gradients behind
        trainer.optimizer.zero_grad(set_to_none=True)
        put_back_weights(self.weights)
        trainer.strategy.reshard(trainer.module)
        trainer.optimizer.load_state_dict(self.optimizer)
        trainer.training_state.restore(self.parts, KEPT_PARTS)
        trainer._fit_metrics.reset()
        trainer._callback_metrics, trainer._logged_metrics = dict(self.metrics[0]), dict(self.metrics[1])
        trainer._unread_steps = UnreadStepValues()  # the trial steps' values, unread: gone with them
        trainer.should_stop = False


def run_trial(
    trainer: Trainer,
    steps: int,
    callbacks: Sequence[Callback],
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
) -> None:
    """`Trainer.run_trial`: the steps on a `TrialLoop`, the Trainer's callbacks, loggers and schedule set aside
    meanwhile, then the training state they changed put back (also when a step failed)."""
    fit = trainer._fit_loop
    if fit is None or not trainer.fitting:
        raise RuntimeError(
            "trial steps run inside a fit; allowed: call run_trial from on_fit_start or a later hook"
        )
    if not trainer.module.automatic_optimization:
        raise RuntimeError(
            "the LR and batch size finders' trial steps are automatic optimization's; allowed here: a module "
            "with automatic_optimization=True (manual optimization is not tuned by them)"
        )
    kept = KeptState(trainer)
    aside = (
        trainer.callbacks,
        trainer.loggers,
        trainer._scheduler_config,
        trainer.lr_scheduler,
        trainer._schedule,
        trainer._step_hooks,
    )
    try:
        trainer.callbacks, trainer.loggers = list(callbacks), []
        if lr_scheduler is not None:
            trainer.use_lr_scheduler(lr_scheduler(trainer.optimizer), interval="step")
        trainer._fit_loop = TrialLoop(fit, steps)
        trainer._fit_loop.run_steps()
    finally:
        trainer._fit_loop = fit
        (
            trainer.callbacks,
            trainer.loggers,
            trainer._scheduler_config,
            trainer.lr_scheduler,
            trainer._schedule,
            trainer._step_hooks,
        ) = aside
        kept.restore()


def reload_fit_loaders(trainer: Trainer) -> None:
    """`Trainer.reload_dataloaders`: the fit's loaders read again from its datamodule or module, made this
    rank's as at the fit's start (a val loader passed to `fit` stays)."""
    train_given, val_given = trainer._loaders_given
    if train_given:
        raise ValueError(
            "the fit's train loader was passed to fit(), so it cannot be read again with a new batch size; allowed: "
            "a train_dataloader() of the module or datamodule (as Lightning's batch size finder asks)"
        )
    train, val = loaders_from(trainer.datamodule or trainer.module, "fit")
    fit = trainer._fit_loop
    # a new EpochBatches: the new loader is read from its start, whatever position the old one had
    fit.train_batches = EpochBatches(fit_loader(trainer, train, train=True), trainer.limit_train_batches)
    if val is not None and not val_given:
        fit.val_loader = fit_loader(trainer, val, train=False)


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)
