"""WeightAveraging and EMAWeightAveraging: Lightning 2.6's averaged copy of the model (torch's `AveragedModel`,
with `use_buffers=True` by default), updated after optimizer steps (and epochs) as `should_update` decides,
swapped in for validation and copied into the model when training ends."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

from callbacks.base import Callback
from trainer.core.logging import log
from trainer.module import TrainModule

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class WeightAveraging(Callback):
    """An `AveragedModel` of the module (equal weights, SWA, unless `avg_fn`/`multi_avg_fn` is given: the
    keyword arguments go to AveragedModel), kept on `device` (default: the module's). Override
    `should_update(step_idx=None, epoch_idx=None)` to choose when it updates (default: after every optimizer
    step). Checkpoints hold its state under the callback's key (Lightning: in the checkpoint's "state_dict")."""

    def __init__(
        self, device: torch.device | str | int | None = None, use_buffers: bool = True, **kwargs: Any
    ) -> None:
        self._device = torch.device(device) if isinstance(device, str) else device
        self._use_buffers = use_buffers
        self._kwargs = kwargs
        self._average_model: AveragedModel | None = None
        # the optimizer steps taken at the last update: zero makes the first call come after the first step
        self._latest_update_step = 0
        # the epoch after which it last updated: below zero, so that should_update(epoch_idx=0) may update
        self._latest_update_epoch = -1

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether to update after optimizer step `step_idx` or epoch `epoch_idx` (0-based, one of them given)."""
        return step_idx is not None

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if stage != "fit":
            return
        device = self._device or module.device
        if type(module).configure_model is not TrainModule.configure_model:
            log.warning(
                "You're using the WeightAveraging callback with a model that overrides the configure_model callback. "
                "WeightAveraging doesn't support sharding model layers, so you may run out of memory."
            )
            module.configure_model()
        self._average_model = AveragedModel(
            model=module, device=device, use_buffers=self._use_buffers, **self._kwargs
        )

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        step_idx = trainer.global_step - 1
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            self._average_model.update_parameters(module)
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            self._average_model.update_parameters(module)
            self._latest_update_epoch = epoch

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._copy_average_to_current(trainer, module)

    def on_validation_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        if self._average_model is not None:
            self._swap_models(trainer, module)

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._average_model is not None:
            self._swap_models(trainer, module)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"latest_update_step": self._latest_update_step}
        if self._average_model is not None:
            state["average_model_state"] = self._average_model.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._latest_update_step = state["latest_update_step"]
        if self._average_model is None:
            log.warning(
                "You're using the WeightAveraging callback, but loading a checkpoint outside the 'fit' stage. The "
                "WeightAveraging state cannot be restored."
            )
        elif "average_model_state" in state:
            self._average_model.load_state_dict(state["average_model_state"])

    def on_load_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict[str, Any]) -> None:
        if self._average_model is not None and self.state_key not in checkpoint.get("callbacks", {}):
            log.warning(
                "The checkpoint was not created with WeightAveraging. Both the current and the average model will "
                "be initialized with state_dict."
            )
            self._average_model.module.load_state_dict(module.state_dict(), strict=False)

    def _swap_models(self, trainer: Trainer, module: TrainModule) -> None:
        """Exchange the values of the module's parameters and buffers with the averaged ones."""
        for average, current in zip(_tensors(self._average_model.module), _tensors(module), strict=True):
            kept = average.data.clone()
            average.data.copy_(current.data)
            current.data.copy_(kept)
        trainer.strategy.reshard(module)

    def _copy_average_to_current(self, trainer: Trainer, module: TrainModule) -> None:
        for average, current in zip(_tensors(self._average_model.module), _tensors(module), strict=True):
            current.data.copy_(average.data)
        trainer.strategy.reshard(module)


class EMAWeightAveraging(WeightAveraging):
    """An exponential moving average of the weights (`decay`), updated every `update_every_n_steps` optimizer
    steps from `update_starting_at_step`, or after each epoch from `update_starting_at_epoch`."""

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device=device, use_buffers=use_buffers, **kwargs, avg_fn=get_ema_avg_fn(decay=decay))
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            due = self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0
            if started and due:
                return True
        start_epoch = self.update_starting_at_epoch
        return epoch_idx is not None and start_epoch is not None and epoch_idx >= start_epoch


def _tensors(module: torch.nn.Module) -> Any:
    """Parameters, then buffers, in the module's order (the averaged copy has the same)."""
    return itertools.chain(module.parameters(), module.buffers())
