"""The data side of DP-SGD: Poisson sampling of logical batches, shared across data-parallel ranks, and
the physical chunks a logical batch is split into.

Every step draws one Poisson sample of the whole dataset (each example independently, with probability
q) from a generator seeded by (seed, epoch), identical on every rank; rank r reads the r-th of every
`world` selected examples. The union over ranks is that one sample, so 2 processes train on the same
logical batches as 1 — which the privacy analysis (amplification by sampling) assumes. A step may select
nobody on some rank: the loader then yields a zero-length batch of the dataset's structure."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from trainer.core.tree import apply_to_tensors

_MIX = 0x9E3779B97F4A7C15  # mixes (seed, epoch) into one generator seed


class PoissonBatchSampler:
    """`steps` batches per epoch; each holds this rank's share of a Poisson sample with rate `rate` of
    `num_examples` examples. Deterministic in (seed, epoch), so a resumed run redraws the same batches."""

    def __init__(self, num_examples: int, rate: float, steps: int, rank: int, world: int, seed: int) -> None:
        self.num_examples, self.rate, self.steps = num_examples, rate, steps
        self.rank, self.world, self.seed = rank, world, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed((self.seed * _MIX + self.epoch) % 2**63)
        for _ in range(self.steps):
            chosen = (torch.rand(self.num_examples, generator=g) < self.rate).nonzero().flatten()
            yield chosen[self.rank :: self.world].tolist()


class _EmptyAware:
    """The loader's collate_fn, but an empty selection becomes a zero-length batch shaped like the data."""

    def __init__(self, dataset: Dataset, collate: Any) -> None:
        self.dataset, self.collate = dataset, collate or default_collate

    def __call__(self, samples: list[Any]) -> Any:
        if samples:
            return self.collate(samples)
        return apply_to_tensors(self.collate([self.dataset[0]]), lambda t: t[:0])


def poisson_loader(loader: Any, world: int, rank: int, seed: int) -> tuple[DataLoader, float, int]:
    """`loader` (a DataLoader, or any loader with a map-style `dataset` and an int `batch_size`, such as
    the recipes' TokenLoader) re-cut into Poisson-sampled logical batches whose expected global size is
    its batch size x `world`; returns (loader, sample rate q, expected global batch size)."""
    n = len(loader.dataset)
    expected = loader.batch_size * world
    if expected > n:
        raise ValueError(
            f"batch_size={loader.batch_size} x {world} process(es) = {expected} is more than the dataset's {n} "
            "examples; allowed: an expected global batch of at most the dataset size"
        )
    rate = expected / n
    steps = max(1, round(1 / rate))  # one epoch sees every example once in expectation
    sampler = PoissonBatchSampler(n, rate, steps, rank, world, seed)
    workers = getattr(loader, "num_workers", 0)
    wrapped = DataLoader(
        loader.dataset,
        batch_sampler=sampler,
        collate_fn=_EmptyAware(loader.dataset, getattr(loader, "collate_fn", None)),
        num_workers=workers,
        pin_memory=getattr(loader, "pin_memory", False),
        worker_init_fn=getattr(loader, "worker_init_fn", None),
        persistent_workers=getattr(loader, "persistent_workers", False) if workers else False,
    )
    return wrapped, rate, expected


def batch_length(batch: Any) -> int:
    """Samples in `batch`: dim 0 of its tensors (they must agree: DP-SGD's unit of privacy is dim 0)."""
    sizes: set[int] = set()
    apply_to_tensors(batch, lambda t: sizes.add(t.shape[0]) or t)
    if len(sizes) != 1:
        raise ValueError(
            f"DP-SGD needs every tensor of a batch to hold the samples along dim 0; got dim-0 sizes {sorted(sizes)}"
        )
    return sizes.pop()


def split_batch(batch: Any, size: int) -> list[Any]:
    """`batch` cut along dim 0 into chunks of at most `size` samples (physical batches of a logical one)."""
    n = batch_length(batch)
    return [apply_to_tensors(batch, lambda t, s=start: t[s : s + size]) for start in range(0, n, size)]
