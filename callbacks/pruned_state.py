"""A pruned module's state dict as Lightning's ModelPruning puts it in checkpoints: each pruned tensor as its
final value (`weight = weight_orig * weight_mask`) under its own name, so a checkpoint loads into the unpruned
model (a resume, `load_from_checkpoint`, an export) while training goes on with the mask."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def fold_pruned_state(pruned: Iterable[tuple[nn.Module, str]]) -> list[RemovableHandle]:
    """Hooks on each (module, name) that fold its pruning into `state_dict` and, when such a state is loaded
    back into the still pruned module (a rollback, a reload check), unfold it: the loaded values go to
    `<name>_orig` where the mask keeps them, the mask stays. Remove the handles when pruning ends."""
    handles: list[RemovableHandle] = []
    for module in {id(m): m for m, _ in pruned}.values():
        names = sorted({n for m, n in pruned if m is module})
        handles.append(module.register_state_dict_post_hook(_folding(names)))
        handles.append(module.register_load_state_dict_pre_hook(_unfolding(names)))
    return handles


def _folding(names: list[str]) -> Any:
    def fold(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name in names:
            key = f"{prefix}{name}"
            if f"{key}_orig" in state and f"{key}_mask" in state:
                orig, mask = state.pop(f"{key}_orig"), state.pop(f"{key}_mask")
                state[key] = (mask.to(orig.dtype) * orig).detach()

    return fold


def _unfolding(names: list[str]) -> Any:
    def unfold(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        for name in names:
            mask = getattr(module, f"{name}_mask", None)
            key = f"{prefix}{name}"
            if mask is None or key not in state or f"{key}_orig" in state:
                continue
            current = getattr(module, f"{name}_orig")
            loaded = state.pop(key).to(current.device, current.dtype)
            state[f"{key}_orig"] = torch.where(mask.bool(), loaded, current.detach())
            state[f"{key}_mask"] = mask.detach().clone()

    return unfold
