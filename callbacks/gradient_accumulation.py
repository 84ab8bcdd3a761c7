"""GradientAccumulationScheduler: change the gradient accumulation factor from given epochs on (Lightning's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class GradientAccumulationScheduler(Callback):
    """`scheduling={epoch: factor}`: from each (0-based) epoch on, every optimizer step accumulates `factor`
    micro-batches (before the first key: 1). The factor is set at each epoch's start, a resumed one's
    included; an epoch whose batches do not divide ends with a shorter step."""

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not scheduling:
            raise TypeError(
                "GradientAccumulationScheduler got an empty scheduling; allowed: {epoch: factor, ...}"
            )
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in scheduling):
            raise ValueError(
                f"GradientAccumulationScheduler epochs {list(scheduling)} are invalid; allowed: ints >= 0"
            )
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in scheduling.values()):
            raise ValueError(
                f"GradientAccumulationScheduler factors {list(scheduling.values())} are invalid; allowed: ints >= 1"
            )
        # a copy (Lightning adds {0: 1} to the caller's own dict)
        self.scheduling = {0: 1, **scheduling}
        self.epochs = sorted(self.scheduling)

    def going_to_accumulate_grad_batches(self) -> bool:
        """Whether any epoch accumulates more than one micro-batch per step."""
        return any(v > 1 for v in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """The factor of `epoch`: that of the last scheduled epoch at or before it."""
        return self.scheduling[max(e for e in self.epochs if e <= epoch)]

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not getattr(module, "automatic_optimization", True):
            raise RuntimeError(
                "GradientAccumulationScheduler needs automatic optimization; allowed: remove the callback, or "
                "automatic_optimization = True"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and GradientAccumulationScheduler "
                "both set the accumulation; allowed: one of the two"
            )

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        trainer.accumulate_grad_batches = self.get_accumulate_grad_batches(trainer.current_epoch)
