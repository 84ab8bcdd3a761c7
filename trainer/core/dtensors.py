"""DTensor checks that do not import DTensor: `torch.distributed.tensor` is ~0.4 s of a process's start-up
(DCP's ~0.3 s more) that a one-process run never needs (torch's own DDP and FSDP2 load it in every rank).
Until something imported it (FSDP2, tensor parallelism, DCP, dynamo), no DTensor can exist, so "not
imported" means "not a DTensor"."""

from __future__ import annotations

import sys

import torch


def is_dtensor(t: object) -> bool:
    """Whether `t` is a DTensor, without importing torch.distributed.tensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


_PLAIN = {torch.Tensor, torch.nn.Parameter}  # the types no DTensor has


def local_parts(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`local_part` of each of `tensors`: the list itself when none is a DTensor (this runs every step)."""
    module = sys.modules.get("torch.distributed.tensor")
    # (an optimizer imports it, through torch._dynamo: then the types are looked at in one pass in C, not
    # one Python test per tensor)
    if module is None or set(map(type, tensors)) <= _PLAIN:
        return tensors
    return [t.to_local() if isinstance(t, module.DTensor) else t for t in tensors]


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered into one plain tensor on every rank; any other tensor as it is."""
    return t.full_tensor() if is_dtensor(t) else t
