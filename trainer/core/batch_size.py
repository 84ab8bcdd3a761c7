"""The batch size Lightning infers for `self.log(..., on_epoch=True)` means when no `batch_size` is given:
the first dimension of the first tensor in the batch (a 0-d tensor counts 1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def infer_batch_size(batch: Any, name: str) -> tuple[int, bool]:
    """(size, ambiguous): the first tensor's first dimension in `batch` (dicts, sequences, dataclasses, in
    order), and whether another tensor disagrees; a one-line ValueError naming the metric when the batch
    holds no tensor."""
    sizes = _sizes(batch)
    first = next(sizes, None)
    if first is None:
        raise ValueError(
            f"log({name!r}) could not infer the batch size from the batch (it holds no tensor); allowed: "
            f"log({name!r}, ..., batch_size=N)"
        )
    return first, any(size != first for size in sizes)


def _sizes(batch: Any) -> Iterator[int]:
    if isinstance(batch, torch.Tensor):
        yield batch.shape[0] if batch.dim() else 1
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _sizes(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _sizes(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from _sizes(getattr(batch, field.name))
