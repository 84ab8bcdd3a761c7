"""The dispatch seam of a MoE layer, apart from any model: what a router decided (`Routing`) and the
dispatcher that keeps every token on this rank (`LocalDispatcher`). An expert-parallel strategy builds
its all-to-all dispatcher on these without importing a model (trainer/models/moe.py uses them). It lives
in the foundation, below both, because the model and the strategy share it: neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Routing:
    """What the router decided for N tokens: expert ids and gates (N, k), `keep` (N, k) False for pairs
    dropped by capacity, the fp32 scores (N, E), and detached statistics for logging."""

    indices: torch.Tensor
    gates: torch.Tensor
    keep: torch.Tensor | None
    scores: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor


class LocalDispatcher:
    """Permute the kept (token, choice) pairs so each expert's tokens are contiguous, and back.

    dispatch -> (tokens (M, dim) sorted by expert, counts (E,) int, ctx); combine(out (M, dim), ctx) ->
    (N, dim): each pair's output times its gate, summed over the token's k choices (dropped pairs add 0).
    """

    def dispatch(
        self, x: torch.Tensor, routing: Routing, n_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        n_tokens, k = routing.indices.shape
        flat = routing.indices.flatten()
        order = torch.argsort(flat, stable=True)  # pair ids sorted by expert (token order within an expert)
        if routing.keep is not None:
            order = order[routing.keep.flatten()[order]]
        counts = torch.bincount(flat[order], minlength=n_experts)
        tokens = x[order // k]
        return tokens, counts, (order, n_tokens, k)

    def combine(self, out: torch.Tensor, routing: Routing, ctx: Any) -> torch.Tensor:
        order, n_tokens, k = ctx
        weighted = out * routing.gates.flatten()[order].unsqueeze(-1).to(out.dtype)
        pairs = out.new_zeros(n_tokens * k, out.shape[-1])
        pairs = pairs.index_copy(0, order, weighted)  # each pair written once: deterministic
        return pairs.view(n_tokens, k, -1).sum(1)

    def load(self, counts: torch.Tensor, ctx: Any) -> torch.Tensor:
        """This rank's kept (token, choice) pairs per expert (E,), for the layer's statistics."""
        return counts
