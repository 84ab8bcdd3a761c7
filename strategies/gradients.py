"""This rank's gradients of a module, scaling them in place in one fused op (DTensors included), and the
norm of FSDP2's sharded gradients in one all-reduce."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from trainer.core.dtensors import is_dtensor, local_parts


def _grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def scale_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply `tensors` in place by the scalar `factor`, in one fused op over this rank's values: a scalar
    scales each shard, replica and pending partial sum of a DTensor alike, so the op needs none of DTensor's
    sharding propagation (uncached on each new mesh: most of a small model's first step) nor one op per mesh."""
    if tensors:  # (a foreach op refuses an empty list: a step without gradients)
        torch._foreach_mul_(local_parts(tensors), factor)


def shard_group(grads: list[torch.Tensor]) -> dist.ProcessGroup | None:
    """The process group whose sum makes the norm of `grads` where they are DTensors of one dtype sharded
    alike over one dimension of one mesh, replicated over any other (FSDP2's, HSDP's); else None."""
    if not grads or not all(is_dtensor(g) for g in grads) or len({g.dtype for g in grads}) != 1:
        return None
    layouts = {(g.device_mesh, g.placements) for g in grads}
    if len(layouts) != 1:
        return None
    mesh, placements = layouts.pop()
    sharded = [dim for dim, placement in enumerate(placements) if placement.is_shard()]
    others_replicated = all(p.is_shard() or p.is_replicate() for p in placements)
    return mesh.get_group(sharded[0]) if len(sharded) == 1 and others_replicated else None


def sharded_norm(
    grads: list[torch.Tensor], group: dist.ProcessGroup, extra: torch.Tensor | None = None
) -> torch.Tensor:
    """The L2 norm of `grads` sharded over `group` (see `shard_group`): the DTensor norm's operations (each
    shard's norm squared, summed over the group, the roots' norm; the same bits) in one all-reduce, without
    its per-op dispatch. `extra` (small counts) is summed over the group by the same all-reduce, in place."""
    local = torch.stack(torch._foreach_norm([g.to_local() for g in grads], 2.0))
    parts = [local**2] if extra is None else [local**2, extra.to(local.dtype)]  # counts: exact in any dtype
    sums = torch.cat(parts)
    dist.all_reduce(sums, group=group)
    if extra is not None:
        extra.copy_(sums[len(grads) :])
    return torch.linalg.vector_norm(sums[: len(grads)] ** 0.5)
