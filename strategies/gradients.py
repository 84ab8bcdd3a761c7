"""This rank's gradients of a module, and scaling them in place in one fused op (DTensors included)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from trainer.core.dtensors import local_parts


def _grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def scale_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply `tensors` in place by the scalar `factor`, in one fused op over this rank's values: a scalar
    scales each shard, replica and pending partial sum of a DTensor alike, so the op needs none of DTensor's
    sharding propagation (uncached on each new mesh: most of a small model's first step) nor one op per mesh."""
    if tensors:  # (a foreach op refuses an empty list: a step without gradients)
        torch._foreach_mul_(local_parts(tensors), factor)
