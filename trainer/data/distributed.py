"""Shard a user's DataLoader by data-parallel rank, so each replica reads a disjoint part of the data.

Map-style datasets get a DistributedSampler (seeded, reshuffled per epoch through `set_epoch`; the
loader's `drop_last` also decides the dataset's uneven tail: dropped, or padded with repeated samples
so every rank has as many batches as the others). Iterable datasets are read in rounds of `size`
items, rank r keeping the r-th of each round; an incomplete last round is dropped, for the same reason.
With DataLoader workers, worker w of W keeps only the rounds k with k % W == w, so a rank yields each of
its samples once, the same ones as without workers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    get_worker_info,
)
from torch.utils.data._utils import worker as worker_module
from torch.utils.data.sampler import BatchSampler

# DataLoader arguments carried over to the sharded copy
_LOADER_ARGS = (
    "batch_size",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
)


class RoundRobinShard(IterableDataset):
    """Rank `rank`'s share of an iterable dataset: item r of every complete round of `size` items, each
    round read by one DataLoader worker (round k by worker k % num_workers)."""

    def __init__(self, dataset: IterableDataset, rank: int, size: int) -> None:
        self.dataset, self.rank, self.size = dataset, rank, size

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        round_: list[Any] = []
        rounds = 0
        for item in _whole_stream(self.dataset):
            round_.append(item)
            if len(round_) == self.size:
                if rounds % workers == worker:
                    yield round_[self.rank]
                round_ = []
                rounds += 1


def _whole_stream(dataset: IterableDataset) -> Iterator[Any]:
    """`dataset`'s items as one process reads them: a dataset that splits itself over DataLoader workers
    (get_worker_info(), as PyTorch's docs show) would otherwise lose the rounds its other workers read,
    as RoundRobinShard already divides the stream over the workers."""
    with _outside_worker():
        items = iter(dataset)
    while True:
        with _outside_worker():
            try:
                item = next(items)
            except StopIteration:
                return
        yield item


@contextmanager
def _outside_worker() -> Iterator[None]:
    """get_worker_info() is None inside the block (torch keeps it in one module global)."""
    saved = worker_module._worker_info
    worker_module._worker_info = None
    try:
        yield
    finally:
        worker_module._worker_info = saved


def shard_loader(loader: Any, rank: int, size: int, seed: int) -> Any:
    """`loader` for data-parallel rank `rank` of `size`; loaders that shard themselves (a
    `shard_for_rank(rank, world_size)` method, as TokenLoader has) are told their rank instead."""
    _refuse_hf_dataset(loader)
    if callable(getattr(loader, "shard_for_rank", None)):
        loader.shard_for_rank(rank, size)
        return loader
    if size == 1 or not isinstance(loader, DataLoader):
        return loader
    if isinstance(loader.sampler, DistributedSampler):
        return loader  # already sharded by the user
    kwargs = _loader_kwargs(loader)
    if isinstance(loader.dataset, IterableDataset):
        return DataLoader(RoundRobinShard(loader.dataset, rank, size), **kwargs)
    sampler = loader.sampler
    if (
        loader.batch_size is None
        or type(loader.batch_sampler) is not BatchSampler
        or not isinstance(sampler, (RandomSampler, SequentialSampler))
    ):
        raise ValueError(
            f"cannot shard a DataLoader with a custom sampler or batch_sampler ({type(sampler).__name__}) over "
            f"{size} data-parallel ranks; allowed: shuffle=True/False loaders, a DistributedSampler of your own, "
            "or a loader with a shard_for_rank(rank, world_size) method"
        )
    shuffle = isinstance(sampler, RandomSampler)
    sampler = DistributedSampler(
        loader.dataset, size, rank, shuffle=shuffle, seed=seed, drop_last=loader.drop_last
    )
    return DataLoader(loader.dataset, sampler=sampler, **kwargs)


def sequential_loader(loader: Any) -> Any:
    """`loader` read in order, the same batches every epoch (Lightning's `overfit_batches`): a DataLoader
    that shuffles is rebuilt over a SequentialSampler; any other loader is its own order, and comes back."""
    if (
        not isinstance(loader, DataLoader)
        or not isinstance(loader.sampler, RandomSampler)
        or type(loader.batch_sampler) is not BatchSampler
    ):
        return loader
    return DataLoader(loader.dataset, sampler=SequentialSampler(loader.dataset), **_loader_kwargs(loader))


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """The arguments a copy of `loader` over another sampler or dataset keeps."""
    kwargs = {name: getattr(loader, name) for name in _LOADER_ARGS if hasattr(loader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
    return kwargs


def _refuse_hf_dataset(loader: Any) -> None:
    """A Hugging Face dataset yields rows of Python lists, not batches: say what to pass instead."""
    hf = sys.modules.get("datasets")  # not imported: `loader` cannot be one of its datasets
    if hf is None or not isinstance(
        loader, (hf.Dataset, hf.IterableDataset, hf.DatasetDict, hf.IterableDatasetDict)
    ):
        return
    raise TypeError(
        f"got a datasets.{type(loader).__name__}, which yields single rows, not batches; allowed: a loader over "
        "it, e.g. DataLoader(ds.with_format('torch'), batch_size=8), or the (train, val) loaders of "
        "trainer.data.hf_data.hf_dataloaders(ds, tokenizer, ...)"
    )
