"""BasePredictionWriter: subclass it to write predictions as `predict` makes them (Lightning's)."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class WriteInterval(str, Enum):
    """When a prediction writer writes: after each batch, once at the epoch's end, or both."""

    BATCH = "batch"
    EPOCH = "epoch"
    BATCH_AND_EPOCH = "batch_and_epoch"

    @property
    def on_batch(self) -> bool:
        return self in (WriteInterval.BATCH, WriteInterval.BATCH_AND_EPOCH)

    @property
    def on_epoch(self) -> bool:
        return self in (WriteInterval.EPOCH, WriteInterval.BATCH_AND_EPOCH)


class BasePredictionWriter(Callback):
    """Override `write_on_batch_end` (`write_interval="batch"`), `write_on_epoch_end` ("epoch") or both
    ("batch_and_epoch"). `batch_indices` are the dataset indices of the predicted samples (of a DataLoader
    over a map-style dataset; empty for other loaders): under several processes each rank writes its own
    share, and the indices say which samples those were."""

    def __init__(self, write_interval: str = "batch") -> None:
        allowed = [i.value for i in WriteInterval]
        if write_interval not in allowed:
            raise ValueError(
                f"write_interval={write_interval!r} is invalid; allowed: {', '.join(map(repr, allowed))}"
            )
        self.interval = WriteInterval(write_interval)

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: TrainModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write one batch's `prediction`."""
        raise NotImplementedError(
            f"{type(self).__name__} writes per batch but does not override write_on_batch_end"
        )

    def write_on_epoch_end(
        self,
        trainer: Trainer,
        pl_module: TrainModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        """Write every batch's prediction; `batch_indices` holds one list per loader of each batch's indices."""
        raise NotImplementedError(
            f"{type(self).__name__} writes per epoch but does not override write_on_epoch_end"
        )

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.interval.on_batch:
            indices = trainer.predict_loop.current_batch_indices
            self.write_on_batch_end(trainer, module, outputs, indices, batch, batch_idx, dataloader_idx)

    def on_predict_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self.interval.on_epoch:
            record = trainer.predict_loop
            self.write_on_epoch_end(trainer, module, record.predictions, record.epoch_batch_indices)
