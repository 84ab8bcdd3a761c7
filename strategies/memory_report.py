"""Per-rank memory of a sharded run, measured, next to the ZeRO paper's formulas for its stage.

With P parameters, N data-parallel ranks, fp32 weights and Adam-style state (two tensors per
parameter), ZeRO (Rajbhandari et al. 2020) holds per rank, in bytes:
    stage 1: params 4P,   grads 4P,   optimizer states 8P/N
    stage 2: params 4P,   grads 4P/N, optimizer states 8P/N
    stage 3: params 4P/N, grads 4P/N, optimizer states 8P/N
Our stage 2 is FSDP2 with reshard_after_forward=False: the gathered parameters live from the forward
to the end of the backward, and only the shards stay between steps, so at rest it holds 4P/N of
parameters, better than the paper's 4P. `expected` states what this implementation holds between steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from trainer.core.dtensors import local_part


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this rank stores for `tensors` (a DTensor counts only its local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = local_part(t)
        total += local.numel() * local.element_size()
    return total


@dataclass
class MemoryReport:
    """Bytes held by this rank now, and what the stage's formula expects (params/grads/states)."""

    stage: int
    ranks: int
    parameters: int  # P, the full model's parameter count
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    expected: dict[str, float]

    def lines(self) -> str:
        mb = 1 / 2**20
        measured = (
            f"params {self.params_bytes * mb:.2f} MiB, grads {self.grads_bytes * mb:.2f} MiB, "
            f"optimizer states {self.optimizer_bytes * mb:.2f} MiB"
        )
        expected = ", ".join(f"{k} {v * mb:.2f} MiB" for k, v in self.expected.items())
        return (
            f"memory per rank (ZeRO-{self.stage}, {self.ranks} ranks sharing the parameters, {self.parameters / 1e6:.2f}M "
            f"parameters): now {measured}; a step holds {expected}"
        )


def measure(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, stage: int, ranks: int
) -> MemoryReport:
    """What this rank holds now; grads exist between backward and zero_grad, states after the first step."""
    params = list(module.parameters())
    states = (
        []
        if optimizer is None
        else [
            v
            for s in optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
    )
    count = sum(p.numel() for p in params)
    width = params[0].element_size() if params else 4
    held = 1 if stage == 1 else ranks  # params held whole only by stage 1 at rest (see module docstring)
    return MemoryReport(
        stage=stage,
        ranks=ranks,
        parameters=count,
        params_bytes=local_bytes(params),
        grads_bytes=local_bytes(p.grad for p in params),
        optimizer_bytes=local_bytes(states),
        expected={
            "params": width * count / held,
            "grads": width * count / (1 if stage == 1 else ranks),
            "optimizer states": 2 * 4 * count / ranks,
        },
    )
