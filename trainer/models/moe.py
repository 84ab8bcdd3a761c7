"""Mixture-of-Experts feed-forward for the Llama decoder: a top-k router, routed SwiGLU experts held as 3-D
weights and computed with one grouped matmul, optional always-on shared experts.

The forward is four separable stages, so expert parallelism can later put an all-to-all between them:

    route    (Router)          scores, top-k expert ids, gates, capacity mask, aux statistics
    dispatch (TokenDispatcher) permute the kept (token, choice) pairs by expert -> tokens, counts per expert
    compute  (GroupedExperts)  SwiGLU of every expert on its contiguous slice of the permuted tokens
    combine  (TokenDispatcher) un-permute, weight by the gates, sum the k choices of each token

Router is in moe_router.py, GroupedExperts and SharedExperts in moe_experts.py, MoEConfig in
moe_config.py; here: the layer that chains the stages, and its losses and statistics over layers.

`MoE.dispatcher` is the seam (trainer/core/moe_dispatch.py): `LocalDispatcher` keeps every token on this
rank; an expert-parallel strategy replaces it with one whose `dispatch` also exchanges the permuted tokens
(and counts) with an all-to-all so each rank receives the tokens of its own experts (the experts' weights
sharded on dim 0), and whose `combine` sends the results back before un-permuting.

Under tensor parallelism the layer takes a sequence-sharded DTensor (the Llama's plan) and computes this
rank's tokens only (TorchTitan's ETP=1): the router and shared experts are replicated over the tp ranks,
so their gradients are partial sums that the DTensor machinery adds up. What depends on the whole
sequence is decided over the group of ranks holding its shards (`token_group`), as one process would
on the unsharded sequence: the auxiliary losses' statistics, each expert's capacity and which pairs it
drops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.core.moe_dispatch import LocalDispatcher, Routing
from trainer.models.moe_config import MoEConfig
from trainer.models.moe_experts import GroupedExperts, SharedExperts
from trainer.models.moe_router import Router, counting_forward


class MoE(nn.Module):
    """The MoE feed-forward: route -> dispatch -> experts -> combine, plus the shared experts.

    After each forward `aux_loss` and `z_loss` hold this layer's losses (tensors in the graph, of the
    tokens it routed) and `extra_loss()` is aux_loss_coef * aux + z_loss_coef * z; `stats` sums, for
    logging, what every training forward since `reset_stats()` routed (all micro-batches of a step).
    A sequence-sharded DTensor input (tensor parallelism) is computed shard by shard and gives an output
    of the same layout; `token_group` is then the process group of the ranks that hold the other shards
    (None otherwise), over which the losses and capacity are decided as on the whole sequence.
    """

    def __init__(self, dim: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.router = Router(dim, config)
        self.experts = GroupedExperts(dim, config.moe_ffn_dim, config.n_experts)
        hidden = config.n_shared_experts * config.moe_ffn_dim
        self.shared_experts = SharedExperts(dim, hidden) if hidden else None
        self.dispatcher: Any = LocalDispatcher()
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.token_group: Any = None
        # sums since reset_stats() of the kept pairs per expert, tokens, and the losses times tokens: a
        # buffer, so what restores buffers after a forward that does not count (a pipeline stage's shape
        # inference) restores it too
        self.register_buffer("routed", torch.zeros(config.n_experts + 3), persistent=False)

    def route(self, x: torch.Tensor) -> Routing:
        return self.router(x, self.token_group)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return self.dispatcher.dispatch(x, routing, self.config.n_experts)

    def compute(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.experts(tokens, counts)

    def combine(self, out: torch.Tensor, routing: Routing, ctx: Any) -> torch.Tensor:
        return self.dispatcher.combine(out, routing, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sharded = x if hasattr(x, "device_mesh") else None  # a DTensor
        if sharded is not None:  # tensor parallel: this rank's shard of the sequence is its tokens
            x = sharded.to_local()
            self.token_group = sharded.device_mesh.get_group()
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.route(x)
        tokens, counts, ctx = self.dispatch(x, routing)
        y = self.combine(self.compute(tokens, counts), routing, ctx)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        self.aux_loss, self.z_loss = routing.aux_loss, routing.z_loss
        if self.training and counting_forward():  # not evaluation, nor a checkpoint's recomputation
            load = getattr(self.dispatcher, "load", None)
            self._record(routing, load(counts, ctx) if callable(load) else counts, x.shape[0])
        y = y.view(shape)
        if sharded is None:
            return y
        return type(sharded).from_local(
            y,
            sharded.device_mesh,
            sharded.placements,
            run_check=False,
            shape=sharded.shape,
            stride=sharded.stride(),
        )

    def extra_loss(self) -> torch.Tensor | None:
        """This layer's weighted auxiliary losses of the last forward (None before any forward)."""
        if self.aux_loss is None or self.z_loss is None:
            return None
        return self.config.aux_loss_coef * self.aux_loss + self.config.z_loss_coef * self.z_loss

    @torch.no_grad()
    def _record(self, routing: Routing, counts: torch.Tensor, n_tokens: int) -> None:
        """Add what `moe_stats` needs of this forward to `stats`, kept raw (it reduces them over ranks when
        it logs): kept pairs per expert, tokens, and the losses times this rank's tokens."""
        losses = torch.stack([routing.aux_loss.detach(), routing.z_loss.detach()]).float() * n_tokens
        self.routed += torch.cat([counts.float(), losses.new_tensor([n_tokens]), losses])

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """The sums since `reset_stats()`: "load" (E,), "tokens", "aux_loss" and "z_loss" (times tokens);
        {} when no training forward ran since."""
        E = self.config.n_experts
        if not self.routed[E]:
            return {}
        return dict(
            zip(("load", "tokens", "aux_loss", "z_loss"), self.routed.split([E, 1, 1, 1]), strict=True)
        )

    def reset_stats(self) -> None:
        """Start the statistics afresh (after each optimizer step)."""
        self.routed.zero_()

    # ---- auxiliary-loss-free balancing, driven by the strategy after each optimizer step -------------
    def balancing_load(self) -> torch.Tensor | None:
        """The kept pairs per expert (E,) this rank routed since the last `update_bias`, which the strategy
        sums over the ranks that route other tokens; None when this layer does not balance by bias."""
        return self.router.tokens_per_expert if self.config.bias_update_rate > 0 else None

    def update_bias(self, load: torch.Tensor) -> None:
        """Move the expert bias by `load`, the summed `balancing_load()` of every rank, and count afresh."""
        self.router.tokens_per_expert.copy_(load)
        self.router.update_expert_bias()

    def init_weights(self, normal: Any, std: float, residual_std: float, seeds: list[int]) -> None:
        """Fill every weight with `normal(weight, std, seed)`; seeds: 7 distinct ints (router, w1, w3, w2,
        shared w1, w3, w2). The projections into the residual stream (w2) use residual_std."""
        normal(self.router.gate.weight, std, seeds[0])
        normal(self.experts.w1, std, seeds[1])
        normal(self.experts.w3, std, seeds[2])
        normal(self.experts.w2, residual_std, seeds[3])
        if self.shared_experts is not None:
            normal(self.shared_experts.w1.weight, std, seeds[4])
            normal(self.shared_experts.w3.weight, std, seeds[5])
            normal(self.shared_experts.w2.weight, residual_std, seeds[6])
        self.router.reset_buffers()
        self.reset_stats()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def summed_extra_loss(layers: list[MoE]) -> torch.Tensor | None:
    """The weighted auxiliary losses of the last forward of `layers`, summed (None if none ran). Where
    tensor parallelism split the tokens, each layer's value is already that of the whole sequence, the
    same on every rank, with the gradient of this rank's tokens (see `Router.forward`)."""
    losses = [loss for m in layers if (loss := m.extra_loss()) is not None]
    return torch.stack(losses).sum() if losses else None


def reset_moe_stats(layers: list[MoE]) -> None:
    """Start every layer's router statistics afresh (after each optimizer step)."""
    for m in layers:
        m.reset_stats()


STAT_NAMES = (
    "load_min",
    "load_max",
    "load_cv",
    "imbalance",
    "dropped_frac",
    "aux_loss",
    "z_loss",
    "bias_min",
    "bias_max",
)


def moe_stats(
    layers: list[MoE | None], config: MoEConfig, device: torch.device, all_reduce: Any = None
) -> dict[str, float]:
    """Floats for logging from the training forwards since each MoE layer's `reset_stats()` (a step's
    micro-batches): aux_loss and z_loss (unweighted, each layer's token-weighted mean over forwards and
    ranks) summed over layers; load_min/max/cv, imbalance (max/mean load),
    dropped_frac of each layer's global per-expert load, averaged over layers; bias_min/max over all
    layers; load_e{i} the kept pairs of expert i summed over layers.

    `layers` has one entry per MoE layer of the whole model, None where this rank does not hold it (another
    pipeline stage's). `all_reduce(tensor)`, if given, sums in place over every rank that routes other
    tokens or holds other layers: one collective of (2E + 4) numbers per layer, so the loads are global."""
    E = config.n_experts
    rows = torch.zeros(len(layers), 2 * E + 4, device=device)
    for i, m in enumerate(layers):
        if m is None or not m.stats:
            continue
        s = m.stats
        rows[i, :E] = s["load"]
        rows[i, E] = s["tokens"]
        rows[i, E + 1 : E + 3] = torch.cat([s["aux_loss"], s["z_loss"]])
        rows[i, E + 3 : 2 * E + 3] = m.router.expert_bias
        rows[i, 2 * E + 3] = 1.0  # holders: the bias is the same on each
    if all_reduce is not None:
        all_reduce(rows)
    rows = rows[rows[:, 2 * E + 3] > 0]
    if not len(rows):
        return {}
    load, tokens = rows[:, :E], rows[:, E]
    bias = rows[:, E + 3 : 2 * E + 3] / rows[:, 2 * E + 3 :]
    mean = load.mean(1).clamp_min(1e-9)
    per_layer = torch.stack([
        load.min(1).values, load.max(1).values, load.std(1, unbiased=False) / mean, load.max(1).values / mean,
        1.0 - load.sum(1) / (tokens * config.top_k),
    ]).mean(1)  # fmt: skip
    summed = torch.stack(
        [(rows[:, E + 1] / tokens).sum(), (rows[:, E + 2] / tokens).sum(), bias.min(), bias.max()]
    )
    out = dict(zip(STAT_NAMES, torch.cat([per_layer, summed]).tolist(), strict=True))
    out.update({f"load_e{i}": v for i, v in enumerate(load.sum(0).tolist())})
    return out
