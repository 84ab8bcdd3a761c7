"""The randomly initialised weights of an HFModule, drawn again under the Trainer's seed: a fresh model's
every weight, a pretrained one's weights its folder lacked (a new classification head) and LoRA's
adapters. HFModule builds its model in its constructor, before `Trainer(seed=...)` seeds anything; its
`configure_model` calls `redraw` right after the Trainer seeded, so that the seed (the same on every rank)
decides them, as `torch.manual_seed(seed)` before the constructor would have."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def fresh_modules(hf: nn.Module, missing: Iterable[str] | None) -> list[nn.Module]:
    """The modules of `hf` that own a newly initialised weight: every module when `missing` is None (built
    from a config), else the owners of the `missing` parameter names (built from a folder)."""
    if missing is None:
        return list(hf.modules())
    owners = sorted({name.rpartition(".")[0] for name in missing})
    return [hf.get_submodule(owner) for owner in owners]


def fresh_tensors(fresh: list[nn.Module], wrapper: nn.Module | None) -> list[torch.Tensor]:
    """The parameters `redraw` draws again: those of the `fresh` modules, and under PEFT (`wrapper`) the
    LoRA matrices and the trained copies of the modules it saves."""
    tensors = {id(p): p for m in fresh for p in m.parameters(recurse=False)}
    for module in wrapper.modules() if wrapper is not None else ():
        if _is_lora_layer(module):
            tensors.update((id(p), p) for n, p in module.named_parameters() if "lora_" in n)
        elif _is_saved_copy(module):
            tensors.update((id(p), p) for p in module.modules_to_save.parameters())
    return list(tensors.values())


def fingerprint(tensors: list[torch.Tensor]) -> list[tuple[float, float]]:
    """(sum, sum of squares) of each tensor: whether they were changed since (by a load, by the user)."""
    with torch.no_grad():
        return [(float(t.double().sum()), float(t.double().square().sum())) for t in tensors]


@torch.no_grad()
def redraw(hf: nn.Module, fresh: list[nn.Module], wrapper: nn.Module | None) -> None:
    """Initialise the `fresh` modules of `hf` again with the model's own `_init_weights`, then PEFT's
    adapters (LoRA's A drawn, B zero) and its copies of the saved modules, from torch's RNG now."""
    done: set[int] = set()
    for module in fresh:
        own = [p for p in module.parameters(recurse=False) if id(p) not in done]
        if not own:
            continue  # a weight tied to one drawn already stays tied to it
        for p in own:  # transformers >= 5 skips tensors it marked initialised
            p._is_hf_initialized = False
        if hasattr(module, "_is_hf_initialized"):
            module._is_hf_initialized = False
        hf._init_weights(module)
        for p in own:
            p._is_hf_initialized = True
            done.add(id(p))
    for module in wrapper.modules() if wrapper is not None else ():
        if _is_lora_layer(module):
            for name in list(module.lora_A):
                module.reset_lora_parameters(name, wrapper.peft_config[name].init_lora_weights)
        elif _is_saved_copy(module):
            for copy in module.modules_to_save.values():
                copy.load_state_dict(module.original_module.state_dict())


def _is_lora_layer(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_lora_parameters", None)) and hasattr(module, "lora_A")


def _is_saved_copy(module: nn.Module) -> bool:
    """PEFT's wrapper of a module it trains a copy of (`modules_to_save`, a new head)."""
    return hasattr(module, "original_module") and isinstance(
        getattr(module, "modules_to_save", None), nn.ModuleDict
    )
