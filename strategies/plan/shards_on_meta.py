"""What each rank of a layout will hold, computed on one CPU before any GPU is rented: the model is
built on the meta device and cut, tensor-parallelised, expert-parallelised and sharded exactly as the
strategy does it on that rank, inside a fake process group of the whole world (collectives do nothing,
nothing is allocated). Weights, gradients and AdamW state only: activations depend on the batch and are
not here.

What a rank stores is read off the storage FSDP2 allocates, not the shard's shape: FSDP pads every
dim-0 shard to ceil(dim 0 / ranks) rows, so a rank whose shard is short or empty still stores a full
chunk of weights and gradients. (Parallel3DStrategy shards experts that do not split that way on dim 1.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from strategies.techniques.ep.experts import expert_modules
from trainer.core.dtensors import is_dtensor, local_part

if TYPE_CHECKING:
    from strategies.parallel import ParallelStrategy

GIB = 2**30


@dataclass
class RankMemory:
    """One rank's share of the model: its parameter elements and the bytes they need."""

    rank: int
    stage: int  # its pipeline rank
    blocks: list[str]  # the transformer blocks it holds
    numel: int  # parameter elements of this rank's shards
    expert_numel: int  # of which routed experts' (MoE), sharded over ep and the "expert" mesh
    param_bytes: int  # the storage FSDP allocates for the shards, padding included
    even_param_bytes: int  # what the same parameters would take split evenly over the ranks sharing them
    grad_bytes: int  # FSDP reduces into padded shards of the parameters' dtype
    optimizer_bytes: int  # AdamW: two states per element of the shards, in the parameters' dtype

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def line(self) -> str:
        experts = f" ({_count(self.expert_numel)} in experts)" if self.expert_numel else ""
        uneven = ""
        if self.param_bytes > 1.01 * self.even_param_bytes:  # FSDP's padding is more than rounding
            uneven = (
                "; shards padded where dim 0 does not split over their ranks: an even split would hold "
                f"params {_size(self.even_param_bytes)}"
            )
        return (
            f"rank {self.rank} (pp rank {self.stage}, blocks {_span(self.blocks)}): {_count(self.numel)} "
            f"elements{experts}; params {_size(self.param_bytes)} + grads {_size(self.grad_bytes)} + "
            f"AdamW {_size(self.optimizer_bytes)} = {_size(self.total_bytes)}{uneven}"
        )


def plan_memory(
    strategy: ParallelStrategy,
    make_module: Callable[[], nn.Module],
    world_size: int,
    ranks: list[int] | None = None,
) -> list[RankMemory]:
    """The memory of `ranks` (default: the first rank of each pipeline stage) of `strategy` (a sharding
    strategy with `shard`) over `world_size` ranks, for modules from `make_module`. The first rank of a
    stage holds the most: every rank of it stores the same padded shards, and its shards are full."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's own fake backend

    if dist.is_initialized():
        raise RuntimeError("plan_memory starts its own fake process group; call it outside a distributed job")
    dims = strategy.parallel_dims().resolve(world_size)
    if ranks is None:
        ranks = [stage * (world_size // dims.pp) for stage in range(dims.pp)]
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks {bad} are outside the world of {world_size}; allowed: 0..{world_size - 1}")
    reports = []
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            strategy.mesh = dims.build("cpu")
            module = make_module()
            with torch.device("meta"):
                module.configure_model()
            strategy.shard(module)
            reports.append(_measure(module, rank, strategy.mesh.rank("pp") if dims.pp > 1 else 0))
        finally:
            strategy.mesh = None
            dist.destroy_process_group()
    return reports


def _measure(module: nn.Module, rank: int, stage: int) -> RankMemory:
    experts = {id(p) for layer in expert_modules(module) for p in layer.experts.parameters()}
    numel = expert_numel = stored = even = optimizer = 0
    for p in module.parameters():
        local = local_part(p)
        numel += local.numel()
        expert_numel += local.numel() if id(p) in experts else 0
        stored += local.untyped_storage().nbytes()  # a view of FSDP's padded shard
        even += p.numel() * p.element_size() // _ranks_sharing(p)
        optimizer += 2 * local.numel() * local.element_size()  # zeros_like(shard): unpadded
    blocks = [name for name, _ in module.named_modules() if name.rsplit(".", 2)[-2:-1] == ["layers"]]
    return RankMemory(rank, stage, blocks, numel, expert_numel, stored, even, stored, optimizer)


def _ranks_sharing(p: torch.Tensor) -> int:
    """Over how many ranks a parameter is split: the sizes of the mesh dimensions it is not replicated on
    (FSDP's over the expert mesh is a strided shard, which `is_shard` does not count)."""
    if not is_dtensor(p):
        return 1
    return math.prod(
        s for s, pl in zip(p.device_mesh.shape, p.placements, strict=True) if not pl.is_replicate()
    )


def _count(n: int) -> str:
    """Elements in billions, or millions below 0.1B (a tiny model's line is not all zeros)."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _size(n: int) -> str:
    """Bytes in GiB, or MiB below 0.1 GiB."""
    return f"{n / GIB:.1f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:.1f} MiB"


def _span(blocks: list[str]) -> str:
    """layers.0 .. layers.8, layers.40 .. layers.49 -> "0-8, 40-49" (a rank holds a run per stage)."""
    numbers = sorted(int(b.rsplit(".", 1)[-1]) for b in blocks)
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "none"
