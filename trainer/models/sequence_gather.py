"""Sequence parallelism's gather before the column-parallel projections, keeping only this rank's shard for
their backward (Megatron-LM's sequence parallelism, Korthikanti et al. 2022, Section 4.2.2).

`PrepareModuleInput(Shard(1) -> Replicate)` all-gathers a norm's output for q/k/v (or w1/w3), and each
projection keeps the gathered sequence for its weight gradient: t times this rank's share, every block.
`GatherKeepingShard` gathers the same way, but while the module runs, every tensor autograd saves that is
the gathered sequence (or a view of it) is kept as the shard, gathered again when the backward first needs
it (once for all the projections that read it) and let go after the last one. Values and gradients are the
same; the cost is one more all-gather per norm in the backward. Under activation checkpointing (other
saved-tensor hooks active) it gathers as PrepareModuleInput does: the block's activations are recomputed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle


class GatherKeepingShard(ParallelStyle):
    """The module's first input, a sequence shard (Shard(1), local or DTensor), reaches it gathered
    (a Replicate DTensor); the other inputs pass untouched."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(lambda mod, args: _gather(mod, args, device_mesh))
        module.register_forward_hook(_release, always_call=True)
        return module


def _gather(module: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
    x, *rest = args
    shard = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    full = shard.redistribute(mesh, [Replicate()])
    # (torch has no public query for active saved-tensor hooks: activation checkpointing's are the ones met)
    if torch.is_grad_enabled() and torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
        keep = _KeepShard(shard, full)
        hooks = torch.autograd.graph.saved_tensors_hooks(keep.pack, keep.unpack)
        hooks.__enter__()
        module._keep_shard = (hooks, keep)  # type: ignore[assignment]
    return (full, *rest)


def _release(module: nn.Module, args: Any, output: Any) -> None:
    hooks, keep = module.__dict__.pop("_keep_shard", (None, None))
    if hooks is not None:
        hooks.__exit__(None, None, None)
        if not keep.pending:  # nothing saved the gathered sequence (e.g. autocast saved its own casts)
            keep.shard = None  # every saved tensor holds the unpack hook: it must not hold the shard


class _KeepShard:
    """The pack/unpack pair of one gather: a saved view of `full` is kept as (this holder, its geometry);
    the first unpack gathers the shard again, and later ones reuse that until the last one is done."""

    def __init__(self, shard: DTensor, full: DTensor) -> None:
        self.shard: DTensor | None = shard.detach()
        self.storage = full._local_tensor.untyped_storage().data_ptr()
        self.placements, self.mesh = full.placements, full.device_mesh
        self.gathered: torch.Tensor | None = None
        self.pending = 0

    def pack(self, t: torch.Tensor) -> Any:
        local = t._local_tensor if isinstance(t, DTensor) else None
        if local is None or local.untyped_storage().data_ptr() != self.storage:
            return t
        self.pending += 1
        view = (local.size(), local.stride(), local.storage_offset(), t.size(), t.stride(), t.placements)
        return self, view

    def unpack(self, packed: Any) -> torch.Tensor:
        if not (isinstance(packed, tuple) and len(packed) == 2 and packed[0] is self):
            return packed
        size, stride, offset, shape, global_stride, placements = packed[1]
        if self.gathered is None:
            assert self.shard is not None  # kept while a packed view waits for it
            self.gathered = self.shard.redistribute(self.mesh, self.placements)._local_tensor
        local = self.gathered.as_strided(size, stride, offset)
        self.pending -= 1
        if self.pending == 0:
            self.gathered = None  # the last projection has it now: nothing here keeps it alive
        return DTensor.from_local(
            local, self.mesh, placements, run_check=False, shape=shape, stride=global_stride
        )
