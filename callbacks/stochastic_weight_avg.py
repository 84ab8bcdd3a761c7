"""StochasticWeightAveraging: Lightning's SWA (Izmailov et al., 2018). From epoch `swa_epoch_start` the LR
anneals to `swa_lrs` (torch's SWALR, stepped per epoch, in place of the fit's schedule) and, at the start of
each epoch until the last, the weights are averaged into a copy of the module; when training ends the
average is copied into the module, and a module with BatchNorm layers gets their statistics recomputed by a
pass over the train data (Lightning adds an epoch for it). Its state is saved in checkpoints."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from copy import deepcopy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.swa_utils import SWALR

from callbacks.base import Callback
from trainer.core.logging import log, rank_zero_info

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer

AvgFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_CPU = torch.device("cpu")  # Lightning's default place for the average


class StochasticWeightAveraging(Callback):
    """`swa_lrs`: the SWA LR, one for all param groups or a list; `swa_epoch_start`: an int epoch (1-based) or a
    fraction of max_epochs; `annealing_epochs` and `annealing_strategy` ("cos" or "linear") shape the anneal;
    `avg_fn(averaged, current, n_averaged)` replaces the equal-weight average; the average lives on `device`
    (None: the module's). One optimizer and at most one scheduler; not with sharded parameters."""

    def __init__(
        self,
        swa_lrs: float | list[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: str = "cos",
        avg_fn: AvgFn | None = None,
        device: torch.device | str | None = _CPU,
    ) -> None:
        if (
            isinstance(swa_epoch_start, int)
            and swa_epoch_start < 1
            or (isinstance(swa_epoch_start, float) and not 0 <= swa_epoch_start <= 1)
        ):
            raise ValueError(
                f"swa_epoch_start={swa_epoch_start!r} is invalid; allowed: an int >= 1 or a float in [0, 1]"
            )
        wrong_float = isinstance(swa_lrs, float) and swa_lrs <= 0
        wrong_list = isinstance(swa_lrs, list) and not all(isinstance(lr, float) and lr > 0 for lr in swa_lrs)
        if not isinstance(swa_lrs, (float, list)) or wrong_float or wrong_list:
            raise ValueError(f"swa_lrs={swa_lrs!r} is invalid; allowed: a positive float, or a list of them")
        if avg_fn is not None and not callable(avg_fn):
            raise ValueError(f"avg_fn={avg_fn!r} is invalid; allowed: a callable or None")
        if device is not None and not isinstance(device, (torch.device, str)):
            raise ValueError(f"device={device!r} is invalid; allowed: a torch.device, a str or None")
        self.n_averaged: torch.Tensor | None = None
        self._swa_epoch_start = swa_epoch_start
        self._swa_lrs = swa_lrs
        self._annealing_epochs = annealing_epochs
        self._annealing_strategy = annealing_strategy
        self._avg_fn = avg_fn or self.avg_fn
        self._device = device
        self._model_contains_batch_norm: bool | None = None
        self._average_model: nn.Module | None = None
        self._initialized = False
        self._swa_scheduler: SWALR | None = None
        self._scheduler_state: dict | None = None
        self._group_lrs: list[float] | None = None  # a resumed run's LRs, as its checkpoint had them
        self._init_n_averaged = 0
        self._latest_update_epoch = -1
        self.momenta: dict[nn.modules.batchnorm._BatchNorm, float | None] = {}
        self._max_epochs = -1

    @property
    def swa_start(self) -> int:
        """The first epoch (0-based) that averages."""
        return max(self._swa_epoch_start - 1, 0)

    @property
    def swa_end(self) -> int | float:
        """The last epoch (0-based) of the fit; inf without max_epochs."""
        return math.inf if self._max_epochs == -1 else self._max_epochs - 1

    @staticmethod
    def pl_module_contains_batch_norm(module: nn.Module) -> bool:
        return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        # a copy of the module as it comes, before the strategy moves or wraps it (Lightning's moment)
        self._average_model = deepcopy(module)

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError("StochasticWeightAveraging works with 1 optimizer; allowed: one")
        if len(trainer.lr_scheduler_configs) > 1:
            raise ValueError(
                "StochasticWeightAveraging works with at most 1 lr_scheduler; allowed: one or none"
            )
        if any(hasattr(p, "placements") for p in module.parameters()):
            raise ValueError(
                "StochasticWeightAveraging does not support sharded models (DTensor parameters); allowed: one "
                "process or DDP"
            )
        # without max_epochs (max_steps bounds the fit) the fit is open-ended, as Lightning's max_epochs=-1
        self._max_epochs = -1 if trainer.max_epochs is None else trainer.max_epochs
        if isinstance(self._swa_epoch_start, float):
            if self._max_epochs == -1:
                raise ValueError(
                    "StochasticWeightAveraging with swa_epoch_start as a float needs max_epochs; allowed: an int "
                    "swa_epoch_start"
                )
            self._swa_epoch_start = int(self._max_epochs * self._swa_epoch_start)
        self._model_contains_batch_norm = self.pl_module_contains_batch_norm(module)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        epoch = trainer.current_epoch
        if not self._initialized and self.swa_start <= epoch <= self.swa_end:
            self._initialized = True
            self._average_model = self._average_model.to(self._device or module.device)
            self._start_annealing(trainer, epoch)
            if self.n_averaged is None:
                self.n_averaged = torch.tensor(self._init_n_averaged, dtype=torch.long, device=module.device)
        if self.swa_start <= epoch <= self.swa_end and epoch > self._latest_update_epoch:
            self.update_parameters(self._average_model, module, self.n_averaged, self._avg_fn)
            self._latest_update_epoch = epoch

    def _start_annealing(self, trainer: Trainer, epoch: int) -> None:
        """SWALR on the optimizer, stepped per epoch in place of the fit's schedule (resumed as saved)."""
        optimizer = trainer.optimizers[0]
        if isinstance(self._swa_lrs, float):
            self._swa_lrs = [self._swa_lrs] * len(optimizer.param_groups)
        for lr, group in zip(self._swa_lrs, optimizer.param_groups, strict=True):
            group["initial_lr"] = lr
        self._swa_scheduler = SWALR(
            optimizer,
            swa_lr=self._swa_lrs,
            anneal_epochs=self._annealing_epochs,
            anneal_strategy=self._annealing_strategy,
            last_epoch=self._max_epochs if self._annealing_strategy == "cos" else -1,
        )
        if self._scheduler_state is not None:
            self._swa_scheduler.load_state_dict(self._scheduler_state)
            # the checkpoint put the fit's own schedule's LRs in the groups: the anneal goes on from SWA's
            for group, lr in zip(optimizer.param_groups, self._group_lrs or (), strict=False):
                group["lr"] = lr
        elif epoch != self.swa_start:
            log.warning(
                "SWA is initializing after swa_start without any checkpoint data. This may be caused by loading a "
                "checkpoint from an older version of PyTorch Lightning."
            )
        configs = trainer.lr_scheduler_configs
        if configs:
            if configs[0].interval != "epoch" or configs[0].frequency != 1:
                log.warning(f"SWA is currently only supported every epoch. Found {configs[0]}")
            rank_zero_info(
                f"Swapping scheduler `{type(configs[0].scheduler).__name__}` for `{type(self._swa_scheduler).__name__}`"
            )
        trainer.use_lr_scheduler(self._swa_scheduler, interval="epoch")

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        # current_epoch counts the epochs done: the last is swa_end when the fit ran to max_epochs. Lightning also
        # copies an average that never started (swa_epoch_start after the last epoch): the weights at setup
        ran_to_end = trainer.current_epoch - 1 == self.swa_end or self._max_epochs == -1
        if not ran_to_end or not self.n_averaged:
            return
        self.transfer_weights(self._average_model, module)
        trainer.strategy.reshard(module)
        if self._model_contains_batch_norm and self._max_epochs != -1:
            self.reset_batch_norm_and_save_state(module)
            self._batch_norm_pass(trainer, module)
            self.reset_momenta()

    def _batch_norm_pass(self, trainer: Trainer, module: TrainModule) -> None:
        """The averaged weights' BatchNorm statistics, from `training_step` over this rank's train batches
        without gradients (Lightning's extra epoch, which skips the backward)."""
        strategy, loader = trainer.strategy, trainer.train_dataloader
        count = trainer.num_training_batches
        batches = loader if math.isinf(count) else itertools.islice(loader, int(count))
        with torch.no_grad():
            for batch_idx, batch in enumerate(batches):
                strategy.eval_step(module, "training_step", strategy.batch_to_device(batch), batch_idx)

    @staticmethod
    def transfer_weights(src_pl_module: nn.Module, dst_pl_module: nn.Module) -> None:
        for src_param, dst_param in zip(src_pl_module.parameters(), dst_pl_module.parameters(), strict=True):
            dst_param.detach().copy_(src_param.to(dst_param.device))

    def reset_batch_norm_and_save_state(self, module: nn.Module) -> None:
        """Fresh running statistics with a cumulative average (momentum None), the momenta kept to restore."""
        self.momenta = {}
        for layer in module.modules():
            if not isinstance(layer, nn.modules.batchnorm._BatchNorm):
                continue
            layer.running_mean = torch.zeros_like(layer.running_mean)
            layer.running_var = torch.ones_like(layer.running_var)
            self.momenta[layer] = layer.momentum
            layer.momentum = None
            layer.num_batches_tracked *= 0

    def reset_momenta(self) -> None:
        for layer, momentum in self.momenta.items():
            layer.momentum = momentum

    @staticmethod
    def update_parameters(
        average_model: nn.Module, model: nn.Module, n_averaged: torch.Tensor, avg_fn: AvgFn
    ) -> None:
        """Fold the model's parameters into the average (a copy when nothing was averaged yet)."""
        for p_swa, p_model in zip(average_model.parameters(), model.parameters(), strict=True):
            device = p_swa.device
            p_swa_, p_model_ = p_swa.detach(), p_model.detach().to(device)
            src = p_model_ if n_averaged == 0 else avg_fn(p_swa_, p_model_, n_averaged.to(device))
            p_swa_.copy_(src)
        n_averaged += 1

    @staticmethod
    def avg_fn(
        averaged_model_parameter: torch.Tensor, model_parameter: torch.Tensor, num_averaged: torch.Tensor
    ) -> torch.Tensor:
        """The equal-weight running average."""
        return averaged_model_parameter + (model_parameter - averaged_model_parameter) / (num_averaged + 1)

    def state_dict(self) -> dict[str, Any]:
        scheduler = self._swa_scheduler
        return {
            "n_averaged": 0 if self.n_averaged is None else self.n_averaged.item(),
            "latest_update_epoch": self._latest_update_epoch,
            "scheduler_state": None if scheduler is None else scheduler.state_dict(),
            "group_lrs": None if scheduler is None else [g["lr"] for g in scheduler.optimizer.param_groups],
            "average_model_state": None if self._average_model is None else self._average_model.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._init_n_averaged = state["n_averaged"]
        self._latest_update_epoch = state["latest_update_epoch"]
        self._scheduler_state = state["scheduler_state"]
        self._group_lrs = state.get("group_lrs")
        if self._average_model is not None:
            self._average_model.load_state_dict(state["average_model_state"])
