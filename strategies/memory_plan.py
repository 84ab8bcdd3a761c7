"""What each rank of a layout will hold, computed on one CPU before any GPU is rented: the model is
built on the meta device and cut, tensor-parallelised and sharded exactly as the strategy does it on
that rank, inside a fake process group of the whole world (collectives do nothing, nothing is
allocated). Weights, gradients and AdamW state only: activations depend on the batch and are not here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from strategies.fsdp import FSDPStrategy

GIB = 2**30


@dataclass
class RankMemory:
    """One rank's share of the model: its parameter elements and the bytes they need."""

    rank: int
    stage: int  # its pipeline rank
    blocks: list[str]  # the transformer blocks it holds
    numel: int  # parameter elements stored on this rank
    param_bytes: int
    grad_bytes: int  # gradients take the parameters' dtype (FSDP reduces into the sharded grads)
    optimizer_bytes: int  # AdamW: two fp32 states per element

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def line(self) -> str:
        return (
            f"rank {self.rank} (pp rank {self.stage}, blocks {_span(self.blocks)}): {self.numel / 1e9:.2f}B "
            f"elements; params {self.param_bytes / GIB:.1f} GiB + grads {self.grad_bytes / GIB:.1f} GiB + "
            f"AdamW {self.optimizer_bytes / GIB:.1f} GiB = {self.total_bytes / GIB:.1f} GiB"
        )


def plan_memory(
    strategy: FSDPStrategy, make_module: Callable[[], nn.Module], world_size: int
) -> list[RankMemory]:
    """The memory of the first rank of each pipeline stage (the others of a stage hold the same) of
    `strategy` (a sharding strategy with `shard`) over `world_size` ranks, for modules from `make_module`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's own fake backend

    if dist.is_initialized():
        raise RuntimeError("plan_memory starts its own fake process group; call it outside a distributed job")
    dims = strategy.parallel_dims().resolve(world_size)
    reports = []
    for stage in range(dims.pp):
        rank = stage * (world_size // dims.pp)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            strategy.mesh = dims.build("cpu")
            module = make_module()
            with torch.device("meta"):
                module.configure_model()
            strategy.shard(module)
            reports.append(_measure(module, rank, stage))
        finally:
            strategy.mesh = None
            dist.destroy_process_group()
    return reports


def _measure(module: nn.Module, rank: int, stage: int) -> RankMemory:
    params = list(module.parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    numel = sum(t.numel() for t in local)
    param_bytes = sum(t.numel() * t.element_size() for t in local)
    blocks = [name for name, _ in module.named_modules() if name.rsplit(".", 2)[-2:-1] == ["layers"]]
    return RankMemory(rank, stage, blocks, numel, param_bytes, param_bytes, 8 * numel)


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
