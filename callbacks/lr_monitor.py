"""LearningRateMonitor: log every parameter group's learning rate (and momentum) as training goes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from trainer import flags

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class LearningRateMonitor(Callback):
    """On logged steps (`log_every_n_steps` of the Trainer, or `every_n_steps`), log `lr/group<i>` (or
    `lr/<name>` when a group has a "name") for the step just taken; with `log_momentum`, also Adam's
    beta1 or SGD's momentum as `momentum/...`."""

    def __init__(self, every_n_steps: int | None = None, log_momentum: bool = False) -> None:
        flags.check_int("every_n_steps", every_n_steps, 1, allow_none=True)
        self.every_n_steps, self.log_momentum = every_n_steps, log_momentum
        self._lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainModule, optimizer: Any) -> None:
        self._lrs = [group["lr"] for group in optimizer.param_groups]  # the rate this step uses

    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any]) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every:
            return
        metrics: dict[str, float] = {}
        for i, (group, lr) in enumerate(zip(trainer.optimizer.param_groups, self._lrs, strict=True)):
            name = group.get("name", f"group{i}")
            metrics[f"lr/{name}"] = lr
            if self.log_momentum:
                momentum = group["betas"][0] if "betas" in group else group.get("momentum")
                if momentum is not None:
                    metrics[f"momentum/{name}"] = float(momentum)
        trainer.log_metrics(metrics)
