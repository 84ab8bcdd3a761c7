"""`shape_of`: the planner's ModelShape of a Llama config, read by its fields (strategies never import a
concrete model; trainer.models.llama.LlamaConfig and anything with the same fields fit)."""

from __future__ import annotations

from typing import Any

from strategies.plan.shapes import ModelShape


def shape_of(config: Any) -> ModelShape:
    """The ModelShape of a LlamaConfig-like `config` (vocab_size, dim, n_layers, n_heads, n_kv_heads,
    ffn_dim, tie_embeddings, and `moe` None or with n_experts, top_k, moe_ffn_dim, n_shared_experts,
    capacity_factor, n_dense_layers, moe_every)."""
    moe = getattr(config, "moe", None)
    experts: dict[str, Any] = {}
    if moe is not None:
        experts = dict(
            n_experts=moe.n_experts,
            top_k=moe.top_k,
            expert_ffn_dim=moe.moe_ffn_dim,
            n_shared_experts=moe.n_shared_experts,
            capacity_factor=moe.capacity_factor,
            n_dense_layers=moe.n_dense_layers,
            moe_every=moe.moe_every,
        )
    return ModelShape(
        vocab_size=config.vocab_size,
        dim=config.dim,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        ffn_dim=config.ffn_dim,
        tie_embeddings=config.tie_embeddings,
        **experts,
    )
