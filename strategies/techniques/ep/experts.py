"""What strategies know of a model's mixture-of-experts layers, learnt only through its declared
`expert_modules()` hook (duck-typed; strategies import no model). Each expert module offers:

    experts             its routed experts' weights (a module): sharded by expert parallelism
    dispatcher          the seam an all-to-all dispatcher replaces (trainer/core/moe_dispatch.py)
    balancing_load()    the load counted since the last bias update (E,), or None if it is not balanced
    update_bias(load)   DeepSeek-V3's auxiliary-loss-free step from the load summed over ranks
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def expert_modules(module: Any) -> list[nn.Module]:
    """`module.expert_modules()`, or [] for a module that does not declare the hook."""
    hook = getattr(module, "expert_modules", None)
    return list(hook()) if callable(hook) else []


def moe_config(module: nn.Module) -> Any:
    """The MoE config of a CausalLM's Llama (its config or its built model's), or None."""
    config = getattr(module, "config", None) or getattr(getattr(module, "model", None), "config", None)
    return getattr(config, "moe", None)


def update_expert_biases(
    layers: list[nn.Module], sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Auxiliary-loss-free balancing of `layers` after an optimizer step: their loads stacked, summed
    over the ranks that route other tokens by `sum_over_ranks` (one collective for all the layers), then
    each layer's bias moved. No collective when no layer balances this way (true of every rank that
    holds the same blocks, i.e. of every rank a sum runs over)."""
    balanced = [(m, load) for m in layers if (load := m.balancing_load()) is not None]
    if not balanced:
        return
    loads = sum_over_ranks(torch.stack([load for _, load in balanced]))
    for (m, _), load in zip(balanced, loads, strict=True):
        m.update_bias(load)
