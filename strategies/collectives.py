"""The run's collectives, each over a named group of the ParallelMesh ("world", "batch", "loss", "tp",
...: strategies/parallel_dims.py), so that nothing reduces over the whole world by accident. On a group
of one rank they are no-ops. Strategies expose them as `reduce`, `all_gather_object`, ...; callbacks
agree through `Strategy.any_rank`/`every_rank`, which use `reduce`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from strategies.parallel_dims import ParallelMesh

_OPS = {
    "mean": dist.ReduceOp.SUM,
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
REDUCE_OPS = tuple(_OPS)


def check_reduce_op(op: str) -> str:
    """`op` if `reduce` knows it; a ValueError listing the ops otherwise. One process checks it too, so a
    typo fails on a laptop rather than on the first multi-GPU run."""
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is unknown; allowed: {', '.join(REDUCE_OPS)}")
    return op


def reduce(
    mesh: ParallelMesh, tensor: torch.Tensor, op: str, group: str, device: torch.device
) -> torch.Tensor:
    """All-reduce a copy of `tensor` (on `device`) over the ranks of `group`: "mean", "sum", "max" or "min"."""
    check_reduce_op(op)
    out = tensor.detach().clone().to(device)
    size = mesh.size(group)
    if size > 1:
        dist.all_reduce(out, op=_OPS[op], group=mesh.group(group))
    return out / size if op == "mean" else out


def all_gather_object(mesh: ParallelMesh, obj: Any, group: str) -> list[Any]:
    """Every rank's `obj`, indexed by its rank within `group`."""
    if mesh.size(group) == 1:
        return [obj]
    gathered: list[Any] = [None] * mesh.size(group)
    dist.all_gather_object(gathered, obj, group=mesh.group(group))
    return gathered


def broadcast_object(mesh: ParallelMesh, obj: Any, src: int, group: str) -> Any:
    """Global rank `src`'s `obj`, on every rank of its `group`; `src` must be in this rank's group."""
    if src not in mesh.ranks(group):
        raise ValueError(f"src={src} is not in this rank's {group!r} group; allowed: {mesh.ranks(group)}")
    if mesh.size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=mesh.group(group))
    return box[0]


def barrier(mesh: ParallelMesh, group: str) -> None:
    """Wait for every rank of `group`."""
    if mesh.size(group) > 1:
        dist.barrier(group=mesh.group(group))
