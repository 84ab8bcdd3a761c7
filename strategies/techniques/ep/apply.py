"""Expert parallelism: each rank of the "ep" group keeps E/ep of every MoE layer's experts and exchanges
tokens with the others by all-to-all (strategies/techniques/ep/all_to_all.py)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from strategies.techniques.ep.all_to_all import AllToAllDispatcher, shard_experts
from strategies.techniques.ep.experts import expert_modules


def apply_ep(module: nn.Module, ep_mesh: DeviceMesh, group: Any) -> list[nn.Module]:
    """Every one of `module`'s `expert_modules()`: its experts sharded over `ep_mesh`, its dispatcher an
    all-to-all over `group` (the same ranks). Returns the layers."""
    layers = expert_modules(module)
    for layer in layers:
        shard_experts(layer.experts, ep_mesh)
        layer.dispatcher = AllToAllDispatcher(group)
    return layers
