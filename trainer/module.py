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
        self,
        name: str,
        value: float | torch.Tensor,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Any = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
    ) -> None:
        """Record a metric, as Lightning's `log` does: in training steps by default per step (the mean
        over its micro-batches), in validation/test steps over the whole loop; `on_step`/`on_epoch`
        choose (both: `name_step` and `name_epoch`), `reduce_fx` aggregates ("mean" weighted by
        `batch_size`, "sum", "max", "min"), `sync_dist` reduces over the data-parallel ranks,
        `logger=False` keeps it to `trainer.callback_metrics`, `prog_bar` shows it."""
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__}.log({name!r}) called outside of a Trainer run")
        evaluating = self._trainer.evaluating
        self._trainer.metrics.add(
            name,
            value,
            on_step=(not evaluating) if on_step is None else on_step,
            on_epoch=evaluating if on_epoch is None else on_epoch,
            reduce_fx=reduce_fx,
            batch_size=batch_size,
            sync_dist=sync_dist,
            prog_bar=prog_bar,
            logger=logger,
        )

    def log_dict(self, dictionary: dict[str, float | torch.Tensor], **kwargs: Any) -> None:
        """`log` each entry with the same options."""
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

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
