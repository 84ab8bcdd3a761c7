"""The MoE part of a Llama's config: which blocks are MoE, and how they route and balance."""

from __future__ import annotations

import math
from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEConfig:
    """The MoE part of a Llama: which blocks are MoE and how they route.

    Block i is a MoE block iff i >= n_dense_layers and (i - n_dense_layers) % moe_every == 0
    ("all": the defaults; DeepSeek-V3: n_dense_layers=3; every other block: moe_every=2).

    route_norm None renormalises the top-k gates to sum 1 when top_k > 1 (Mixtral, whose softmax-then-top-k
    renormalised equals a softmax over the k logits, and DeepSeek-V3's sigmoid gates) and keeps the raw score
    for top_k == 1 (Switch Transformer: the gate must not be constant 1, or the router gets no gradient).

    capacity_factor None is dropless; else each expert takes at most ceil(tokens * top_k / n_experts *
    capacity_factor) (token, choice) pairs of a forward, keeping those with the highest router score.

    bias_update_rate > 0 is DeepSeek-V3's auxiliary-loss-free balancing: experts are chosen by top-k of
    score + bias, gates are the raw scores, and `update_expert_bias()` (after each optimizer step) moves the
    bias by rate * sign(mean load - load), mean-centred.
    """

    n_experts: int = 8
    top_k: int = 2
    moe_ffn_dim: int = 256
    n_shared_experts: int = 0
    score_func: str = "softmax"
    route_norm: bool | None = None
    n_dense_layers: int = 0
    moe_every: int = 1
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={self.score_func!r}; allowed: {', '.join(SCORE_FUNCS)}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} with n_experts={self.n_experts}; allowed: 1..n_experts")
        if self.moe_every < 1 or self.n_dense_layers < 0 or self.n_shared_experts < 0:
            raise ValueError("moe_every >= 1, n_dense_layers >= 0 and n_shared_experts >= 0 are required")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor}; allowed: > 0 or None (dropless)")

    @property
    def normalise_gates(self) -> bool:
        return self.top_k > 1 if self.route_norm is None else self.route_norm

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.n_dense_layers and (index - self.n_dense_layers) % self.moe_every == 0

    def capacity(self, n_tokens: int) -> int | None:
        """Most (token, choice) pairs one expert takes from `n_tokens` tokens; None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(n_tokens * self.top_k / self.n_experts * self.capacity_factor)
