"""Activation checkpointing of a model's transformer blocks: each block is wrapped (PyTorch's
`checkpoint_wrapper`) in its parent, so its forward is recomputed in the backward instead of its
activations being stored. The block's own `forward` is never replaced, and the wrapper strips its
prefix from parameter names and state-dict keys, so checkpoints look the same with or without it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MODES = (None, "full", "selective")
# "selective" keeps the outputs of these (the expensive ops) and recomputes the rest: the matmuls, and
# attention under every kernel `scaled_dot_product_attention` may pick (CPU's; CUDA's flash, memory-efficient
# and cuDNN ones; MPS's and other backends'), so that no device reruns attention in the backward
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_attention_math_for_mps.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
}


def check_mode(mode: str | None) -> str | None:
    """`mode` if it is one of MODES; a one-line error naming the flag and the allowed values otherwise."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is invalid; allowed: None, 'full', 'selective'")
    return mode


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The model's declared repeated blocks (`transformer_blocks()`); none declared: an empty list."""
    declared = getattr(module, "transformer_blocks", None)
    if not callable(declared):
        return []
    try:
        return list(declared())
    except AttributeError:  # a wrapper model whose inner model lacks the hook
        return []


def checkpoint_blocks(module: nn.Module, blocks: list[nn.Module], mode: str) -> list[nn.Module]:
    """Replace each of `blocks` inside `module` by its checkpointed wrapper; returns the wrappers, which
    take the blocks' place as FSDP or compile units (TorchTitan's order: checkpoint, then shard)."""
    where = {id(m): name for name, m in module.named_modules()}
    wrapped = []
    for block in blocks:
        if id(block) not in where or not where[id(block)]:
            raise ValueError(
                f"transformer_blocks() returned a {type(block).__name__} that is not a submodule of "
                f"{type(module).__name__}; allowed: submodules only (they are wrapped in place)"
            )
        parent_name, _, child = where[id(block)].rpartition(".")
        kwargs: dict[str, Any] = {"preserve_rng_state": True}
        if mode == "selective":
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _policy)
        wrapper = checkpoint_wrapper(block, **kwargs)
        setattr(module.get_submodule(parent_name), child, wrapper)
        wrapped.append(wrapper)
    return wrapped


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE
