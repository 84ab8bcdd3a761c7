"""LearningRateMonitor: log every parameter group's learning rate (and momentum) as training goes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from trainer import flags

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class LearningRateMonitor(Callback):
    """Log `lr/group<i>` (or `lr/<name>` when a group has a "name"); with `log_momentum`, also Adam's beta1
    or SGD's momentum as `momentum/...`. `logging_interval` is Lightning's: "step" logs on logged steps
    (`log_every_n_steps` of the Trainer, or `every_n_steps`) the rate that step used; "epoch" logs at each
    epoch's start the rate it begins with; None follows the scheduler (`configure_optimizers`' "interval",
    per step without one)."""

    def __init__(
        self,
        logging_interval: str | None = None,
        log_momentum: bool = False,
        every_n_steps: int | None = None,
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(
                f"logging_interval={logging_interval!r} is invalid; allowed: 'step', 'epoch' or None"
            )
        flags.check_int("every_n_steps", every_n_steps, 1, allow_none=True)
        self.logging_interval, self.every_n_steps, self.log_momentum = (
            logging_interval,
            every_n_steps,
            log_momentum,
        )
        self._lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainModule, optimizer: Any) -> None:
        if (
            optimizer is trainer.optimizer
        ):  # the one it logs (under manual optimization, the first of several)
            self._lrs = [group["lr"] for group in optimizer.param_groups]  # the rate this step uses

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps
        if self._interval(trainer) == "step" and trainer.global_step % every == 0:
            trainer.log_metrics(self._stats(trainer, self._lrs))

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        if self._interval(trainer) == "epoch":
            trainer.log_metrics(self._stats(trainer, [g["lr"] for g in trainer.optimizer.param_groups]))

    def _interval(self, trainer: Trainer) -> str:
        if self.logging_interval is not None:
            return self.logging_interval
        configs = trainer.lr_scheduler_configs  # none: the Trainer's own schedule, which steps per step
        return configs[0].interval if configs else "step"

    def _stats(self, trainer: Trainer, lrs: list[float]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for i, (group, lr) in enumerate(zip(trainer.optimizer.param_groups, lrs, strict=True)):
            name = group.get("name", f"group{i}")
            metrics[f"lr/{name}"] = lr
            if self.log_momentum:
                momentum = group["betas"][0] if "betas" in group else group.get("momentum")
                if momentum is not None:
                    metrics[f"momentum/{name}"] = float(momentum)
        return metrics
