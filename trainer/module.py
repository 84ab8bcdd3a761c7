"""TrainModule: the user's model and its steps, the LightningModule of this framework."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class TrainModule(nn.Module):
    """Subclass this: build layers in `__init__` (or late in `configure_model`), define
    `training_step` and `configure_optimizers`, optionally `validation_step`/`test_step`.

    `training_step` returns a loss tensor, or a dict with "loss" and optionally "num_tokens": the number
    of items the loss is a mean over. With "num_tokens" the Trainer weights micro-batches (and data-
    parallel ranks) by it, so gradient accumulation equals one large batch even when micro-batches hold
    different token counts; without it every micro-batch weighs the same.
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None

    # ---- what the user writes -------------------------------------------------------------------
    def configure_model(self) -> None:
        """Build large layers here (it runs under the strategy's init device, e.g. meta for sharding)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must define training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, Any] | None:
        raise NotImplementedError(f"{type(self).__name__} has no validation_step; define it to validate")

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, Any] | None:
        raise NotImplementedError(f"{type(self).__name__} has no test_step; define it to test")

    def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, Any]:
        """An optimizer, or {"optimizer": opt, "lr_scheduler": sched} to use your own scheduler."""
        raise NotImplementedError(f"{type(self).__name__} must define configure_optimizers()")

    # ---- hooks (few, named like Lightning's) ------------------------------------------------------
    def on_fit_start(self) -> None:
        """Called once the model, optimizer and checkpoint are in place, before the first step."""

    def on_fit_end(self) -> None:
        """Called after the last step."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add your own entries (tensors, numbers, strings, lists, dicts) to the checkpoint."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read back what `on_save_checkpoint` added."""

    # ---- provided -------------------------------------------------------------------------------
    def log(
        self, name: str, value: float | torch.Tensor, prog_bar: bool = False, sync_dist: bool = False
    ) -> None:
        """Record a metric; averaged over the step's micro-batches (or the validation epoch), reduced
        over ranks when `sync_dist`, written by rank zero's loggers."""
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__}.log({name!r}) called outside of a Trainer run")
        self._trainer.metrics.add(name, value, prog_bar=prog_bar, sync_dist=sync_dist)

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer")
        return self._trainer

    @property
    def global_step(self) -> int:
        return self._trainer.state.global_step if self._trainer is not None else 0

    @property
    def device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        return self._trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_trainer":  # a back-reference, never a submodule or part of the state dict
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)
