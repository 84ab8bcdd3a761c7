"""Attention inside each example of a packed causal-LM batch (trainer.data.sft_packing) for a Hugging Face
model: rows hold several examples whose `position_ids` restart at 0, and no `attention_mask`.

transformers' masks (`masking_utils`, which its decoders since 4.5x build their masks with) already read
such position ids as packed sequences when no 2-D mask is given: eager and SDPA get a block-diagonal causal
mask, FlashAttention varlen boundaries. A model that builds its masks otherwise would attend across
examples, so it is given an explicit 4-D mask instead, in its attention's own format.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """LongTensor[B, T] numbering the examples of each row: a new one starts wherever the position does
    not follow the previous one by 1 (transformers' own rule, `find_packed_sequence_indices`)."""
    steps = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (steps != 1).cumsum(-1)


def builds_packed_masks(model: nn.Module) -> bool:
    """The model's masks come from transformers' `masking_utils`, which honour packed position ids."""
    module = sys.modules.get(type(model).__module__)
    return module is not None and any(
        getattr(value, "__module__", None) == "transformers.masking_utils" for value in vars(module).values()
    )


def block_causal_mask(position_ids: torch.Tensor, attn_implementation: str) -> torch.Tensor:
    """The 4-D mask [B, 1, T, T] where query t sees key s iff s <= t in the same example: booleans (True:
    attend) for SDPA, additive float32 (0 or the dtype's minimum) for eager attention."""
    segments = segment_ids(position_ids)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal  # [B, T, T]
    allowed = allowed[:, None]
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        zero = torch.zeros((), dtype=torch.float32, device=position_ids.device)
        return torch.where(allowed, zero, torch.finfo(torch.float32).min)
    raise ValueError(
        f"packed batches (position_ids without attention_mask) need a 4-D mask, which attention "
        f"{attn_implementation!r} does not take for this model; allowed: attn_implementation 'sdpa' or 'eager'"
    )


def packed_inputs(
    model: nn.Module, inputs: dict[str, Any], explicit_mask: bool | None = None
) -> dict[str, Any]:
    """`inputs` for `model`, with a block-diagonal 4-D attention mask added when they are packed (position ids
    and no attention mask) and the model would not build one from the position ids itself. `explicit_mask`
    forces the choice (None: decide by `builds_packed_masks`)."""
    if "position_ids" not in inputs or inputs.get("attention_mask") is not None:
        return inputs
    if explicit_mask is None:
        explicit_mask = not builds_packed_masks(model)
    if not explicit_mask:
        return inputs
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    return {**inputs, "attention_mask": block_causal_mask(inputs["position_ids"], implementation)}
