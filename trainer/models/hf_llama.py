"""Mapping between our Llama and Hugging Face `transformers.LlamaForCausalLM`: configs and state-dict keys.

No tensor is permuted: our RoPE uses HF's rotate_half layout. transformers is imported inside the functions
because importing it takes seconds, a cost every worker process would pay for `import trainer.models.llama`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from trainer.models.llama import LlamaConfig

if TYPE_CHECKING:
    import transformers

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_LEVEL_FROM_HF = {hf: ours for ours, hf in _TOP_LEVEL.items()}
_PER_LAYER_FROM_HF = {hf: ours for ours, hf in _PER_LAYER.items()}


def to_hf_config(cfg: LlamaConfig) -> transformers.LlamaConfig:
    """The `transformers.LlamaConfig` of the same architecture."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        attention_bias=False,
        mlp_bias=False,
    )


def from_hf_config(hf_cfg: transformers.LlamaConfig) -> LlamaConfig:
    """Our config for a `transformers.LlamaConfig`; raises ValueError for features this model lacks."""
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in `rope_theta` and `rope_scaling`.
    rope = getattr(hf_cfg, "rope_parameters", None) or {
        "rope_theta": hf_cfg.rope_theta,
        **(hf_cfg.rope_scaling or {}),
    }
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    required = {
        "rope_type": (rope_type, "default"),
        "head_dim": (head_dim, hf_cfg.hidden_size // hf_cfg.num_attention_heads),
        "hidden_act": (hf_cfg.hidden_act, "silu"),
        "attention_bias": (hf_cfg.attention_bias, False),
        "mlp_bias": (getattr(hf_cfg, "mlp_bias", False), False),
    }
    for name, (value, allowed) in required.items():
        if value != allowed:
            raise ValueError(f"Hugging Face config {name}={value!r} is not supported; allowed: {allowed!r}")
    return LlamaConfig(
        vocab_size=hf_cfg.vocab_size,
        dim=hf_cfg.hidden_size,
        n_layers=hf_cfg.num_hidden_layers,
        n_heads=hf_cfg.num_attention_heads,
        n_kv_heads=hf_cfg.num_key_value_heads or hf_cfg.num_attention_heads,
        ffn_hidden=hf_cfg.intermediate_size,
        norm_eps=hf_cfg.rms_norm_eps,
        rope_theta=float(rope["rope_theta"]),
        max_seq_len=hf_cfg.max_position_embeddings,
        tie_embeddings=bool(hf_cfg.tie_word_embeddings),
        init_std=hf_cfg.initializer_range,
    )


def to_hf_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict under Hugging Face key names (same tensors, not copies)."""
    return {_to_hf_key(key): value for key, value in sd.items()}


def from_hf_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama state dict under our key names (same tensors, not copies).

    save_pretrained omits a tied lm_head.weight, so a tied model loads such a dict with strict=False.
    """
    return {
        _from_hf_key(key): value
        for key, value in sd.items()
        # Checkpoints from older transformers carry this derived buffer; ours is recomputed from the config.
        if not key.endswith("rotary_emb.inv_freq")
    }


def _to_hf_key(key: str) -> str:
    if key in _TOP_LEVEL:
        return _TOP_LEVEL[key]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
    if match and match.group(2) in _PER_LAYER:
        return f"model.layers.{match.group(1)}.{_PER_LAYER[match.group(2)]}"
    raise ValueError(f"state-dict key {key!r} has no Hugging Face Llama name")


def _from_hf_key(key: str) -> str:
    if key in _TOP_LEVEL_FROM_HF:
        return _TOP_LEVEL_FROM_HF[key]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
    if match and match.group(2) in _PER_LAYER_FROM_HF:
        return f"layers.{match.group(1)}.{_PER_LAYER_FROM_HF[match.group(2)]}"
    raise ValueError(f"Hugging Face key {key!r} is not a Llama parameter this model has")
