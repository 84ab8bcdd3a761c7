"""Context parallelism: the sequence sharded over the "cp" ranks in load-balanced chunks, attention over
the gathered keys and values (strategies/techniques/cp/attention.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from strategies.techniques.cp.attention import ContextParallel


def apply_cp(module: nn.Module, group: Any, rank: int, size: int, device: torch.device) -> ContextParallel:
    """Give `module` (through its `enable_context_parallel` hook) the ring's attention and this rank's
    positions; returns the ContextParallel that shards each batch."""
    context = ContextParallel(group, rank, size)
    module.enable_context_parallel(context.attention, lambda: context.positions(context.seq_len, device))
    return context
