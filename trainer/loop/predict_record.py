"""What Lightning's `trainer.predict_loop` shows prediction writers (callbacks.BasePredictionWriter): the
running predict's outputs and the dataset indices of its batches."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from trainer.data.distributed import _LOADER_ARGS

# a DataLoader given a batch_sampler takes none of these (they are the batch sampler's)
_BATCH_SAMPLER_ARGS = ("batch_size", "drop_last")


class PredictRecord:
    """`predictions`: every `predict_step` output of the running (or last) predict so far, in order;
    `current_batch_indices`: the dataset indices of the batch in hand; `epoch_batch_indices`: one list per
    loader (one here) of each batch's indices. Indices are known for a `DataLoader` over a map-style
    dataset (its batch sampler is recorded, as Lightning records it); elsewhere they are empty."""

    def __init__(self) -> None:
        self.predictions: list[Any] = []
        self.current_batch_indices: list[int] = []
        self.epoch_batch_indices: list[list[list[int]]] = []
        self._seen: list[list[int]] | None = None

    def start(self, loader: Iterable, predictions: list[Any]) -> Iterable:
        """Begin a predict over `loader`, whose outputs the loop appends to `predictions`; returns the
        loader to iterate: a copy of a DataLoader whose batch sampler records what it yields."""
        self.predictions, self.current_batch_indices, self.epoch_batch_indices = predictions, [], [[]]
        self._seen = None
        # batch_size=None has no batch sampler (each sample is a batch); other loaders have no indices to record
        plain = type(loader) is DataLoader and not isinstance(loader.dataset, IterableDataset)
        if not plain or loader.batch_sampler is None:
            return loader
        recorder = _RecordedBatches(loader.batch_sampler)
        self._seen = recorder.seen
        kwargs = {
            k: getattr(loader, k) for k in _LOADER_ARGS if k not in _BATCH_SAMPLER_ARGS and hasattr(loader, k)
        }
        if kwargs.get("num_workers", 0) == 0:
            kwargs.pop("prefetch_factor", None)
        return DataLoader(loader.dataset, batch_sampler=recorder, **kwargs)

    def batch(self, batch_idx: int) -> None:
        """The batch `batch_idx` is in hand (before its hooks run): its indices become current."""
        indices = self._seen[batch_idx] if self._seen is not None else []
        self.current_batch_indices = indices
        self.epoch_batch_indices[0].append(indices)


class _RecordedBatches:
    """A batch sampler that yields what `inner` yields and keeps each batch's indices in `seen` (the loader
    draws them ahead of the batches it hands out, so they are looked up by batch index)."""

    def __init__(self, inner: Iterable[list[int]]) -> None:
        self.inner = inner
        self.seen: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        self.seen.clear()
        for indices in self.inner:
            self.seen.append(list(indices))
            yield indices

    def __len__(self) -> int:
        return len(self.inner)
