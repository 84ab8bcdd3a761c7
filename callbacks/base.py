"""Callback: the hook list. Each hook is named for the moment it fires; all default to doing nothing.

Order within one optimizer step: on_train_batch_start -> (forward+backward of every micro-batch)
-> on_after_backward -> on_before_optimizer_step -> (step) -> [validation, when due:
on_validation_start -> on_validation_end] -> on_train_batch_end. A "batch" here is everything one
optimizer step consumes (all its accumulation micro-batches), so a hook sees whole steps.

Callbacks steer the run through the Trainer: `should_stop`, `save_checkpoint`, `save_and_stop`,
`skip_optimizer_step` (from on_before_optimizer_step), `rollback`, `loss_on` and `log_metrics`; they
read `step_loss`, `step_grad_norm()`, `clock` and `state`. See trainer.trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class Callback:
    """Subclass and override the hooks you need. State from `state_dict` is saved in checkpoints."""

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint (unique per class by default)."""
        return type(self).__qualname__

    def setup(self, trainer: Trainer, pl_module: TrainModule, stage: str) -> None:
        """Start of fit/validate/test/predict, once the process group and device exist, before the
        module's `setup` and `configure_model` (Lightning's order)."""

    def teardown(self, trainer: Trainer, pl_module: TrainModule, stage: str) -> None:
        """End of fit/validate/test, also after an exception."""

    def on_fit_start(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """Before the first step (after a checkpoint was restored)."""

    def on_fit_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """After the last step."""

    def on_train_start(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """Before the first training step (after on_fit_start)."""

    def on_train_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """After the last training step (before on_fit_end)."""

    def on_train_epoch_start(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """At the start of each training epoch."""

    def on_train_epoch_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """At the end of each training epoch, after its end-of-epoch validation."""

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: TrainModule, batch: Any, batch_idx: int
    ) -> None:
        """Before the micro-batches of an optimizer step: `batch` is the first of them (the only one without
        accumulation), `batch_idx` its index in the epoch."""

    def on_before_backward(self, trainer: Trainer, pl_module: TrainModule, loss: torch.Tensor) -> None:
        """Before the backward of each micro-batch's `loss` (as `training_step` returned it)."""

    def on_after_backward(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """Gradients of the whole step are accumulated, synced and normalised: `.grad` is the gradient of the
        step's mean loss (token-weighted when the step reports num_tokens; fp16's loss scale divided out),
        not yet clipped."""

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: TrainModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """The step's gradients, complete and not yet clipped (as in Lightning: a norm read here is the
        gradient's own); clipping and the optimizer step follow."""

    def on_before_zero_grad(
        self, trainer: Trainer, pl_module: TrainModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """The optimizer stepped; its gradients are about to be cleared."""

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        """After the optimizer step (and validation, when it was due); outputs["loss"] is the step's loss,
        `batch` and `batch_idx` as on_train_batch_start had them."""

    def on_validation_start(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """Before a validation loop."""

    def on_validation_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """After a validation loop; its metrics are in `trainer.callback_metrics`."""

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """Before the first validation batch."""

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """After the last validation batch, before the loop's metrics are computed."""

    def on_sanity_check_start(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """Before the few validation batches that run ahead of training (`num_sanity_val_steps`)."""

    def on_sanity_check_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """After the sanity check; nothing it logged was kept."""

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: TrainModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Before `validation_step` of each batch."""

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """After `validation_step`; `outputs` is what it returned."""

    def on_test_batch_start(
        self, trainer: Trainer, pl_module: TrainModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Before `test_step` of each batch."""

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """After `test_step`; `outputs` is what it returned."""

    def on_predict_batch_start(
        self, trainer: Trainer, pl_module: TrainModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Before `predict_step` of each batch."""

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """After `predict_step`; `outputs` is its prediction."""

    def on_test_start(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """Before a test loop."""

    def on_test_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """After a test loop."""

    def on_test_epoch_start(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """Before the first test batch."""

    def on_test_epoch_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """After the last test batch, before the loop's metrics are computed."""

    def on_predict_start(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """Before a predict loop."""

    def on_predict_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """After a predict loop."""

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """Before the first predict batch."""

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        """After the last predict batch."""

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: TrainModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint's state is being assembled; add to it if needed."""

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: TrainModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint was restored: on resume, or by a rollback (`trainer.rollback`)."""

    def on_straggler(self, trainer: Trainer, pl_module: TrainModule, stragglers: dict[int, float]) -> None:
        """StragglerDetector found ranks slower than the rest: {rank: its time / the median time}."""

    def on_exception(self, trainer: Trainer, pl_module: TrainModule, exception: BaseException) -> None:
        """The run is failing with `exception`."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""


class Checkpoint(Callback):
    """Lightning's base class of the callbacks that save checkpoints (ModelCheckpoint, OnExceptionCheckpoint)."""
