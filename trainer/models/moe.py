"""Mixture-of-Experts feed-forward for the Llama decoder: a top-k router, routed SwiGLU experts held as 3-D
weights and computed with one grouped matmul, optional always-on shared experts.

The forward is four separable stages, so expert parallelism can later put an all-to-all between them:

    route    (Router)          scores, top-k expert ids, gates, capacity mask, aux statistics
    dispatch (TokenDispatcher) permute the kept (token, choice) pairs by expert -> tokens, counts per expert
    compute  (GroupedExperts)  SwiGLU of every expert on its contiguous slice of the permuted tokens
    combine  (TokenDispatcher) un-permute, weight by the gates, sum the k choices of each token

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

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.core.moe_dispatch import LocalDispatcher, Routing

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


def counting_forward() -> bool:
    """True in a forward that should count expert load: grad enabled and not an activation-checkpoint
    recomputation (which runs inside the backward pass, where the autograd graph task id is set).
    With reentrant checkpointing the first forward runs without grad, so nothing is counted: use
    use_reentrant=False."""
    in_backward = getattr(torch._C, "_current_graph_task_id", lambda: -1)() != -1
    return torch.is_grad_enabled() and not in_backward


class Router(nn.Module):
    """Linear scores in float32, top-k of score + expert_bias, gates from the raw score."""

    def __init__(self, dim: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = nn.Linear(dim, config.n_experts, bias=False)
        # persistent: the balancing bias is training state; tokens_per_expert is the load since the last
        # bias update (not saved: an update consumes it).
        self.register_buffer("expert_bias", torch.zeros(config.n_experts, dtype=torch.float32))
        self.register_buffer(
            "tokens_per_expert", torch.zeros(config.n_experts, dtype=torch.float32), persistent=False
        )

    def reset_buffers(self) -> None:
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor, group: Any = None) -> Routing:
        """Route x (N, dim): this rank's tokens of those the ranks of `group` (None: this rank alone) hold;
        the losses and capacity are those of all the group's tokens."""
        c = self.config
        logits = F.linear(x.float(), local_weight(self.gate.weight).float())  # (N, E), fp32
        if c.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
        choose = scores + self.expert_bias if c.bias_update_rate > 0 else scores
        indices = torch.topk(choose.detach(), c.top_k, dim=-1).indices  # (N, k)
        gates = scores.gather(-1, indices)
        if c.normalise_gates:
            gates = gates / gates.sum(-1, keepdim=True)

        E = c.n_experts
        counts = torch.bincount(indices.flatten(), minlength=E).float()
        # sums over the group's tokens: probabilities per expert, squared log-partition, choices per expert,
        # tokens; each rank's gradient is that of its own tokens' terms (they sum to the whole's)
        sums = torch.cat([probs.sum(0), torch.logsumexp(logits, dim=-1).pow(2).sum().view(1)])
        counts_n = torch.cat([counts, counts.new_tensor([x.shape[0]])])
        if group is not None:
            total = torch.cat([sums.detach(), counts_n])
            dist.all_reduce(total, group=group)
            sums, counts_n = sums + (total[: E + 1] - sums.detach()), total[E + 1 :]
        counts, n_tokens = counts_n[:E], counts_n[E]
        # Switch load balancing: E * sum_e f_e P_e, f_e the fraction of the N*k choices that picked e
        # (before capacity), P_e the mean router probability; 1 when perfectly balanced.
        aux_loss = E * (counts / (n_tokens * c.top_k) * sums[:E] / n_tokens).sum()
        z_loss = sums[E] / n_tokens
        keep = None
        if c.capacity_factor is not None:
            keep = capacity_mask(indices, pair_scores(scores, indices), c.capacity(int(n_tokens)), E, group)
        if c.bias_update_rate > 0 and self.training and counting_forward():  # the bias update's only input
            kept = indices.flatten() if keep is None else indices.flatten()[keep.flatten()]
            self.tokens_per_expert += torch.bincount(kept, minlength=c.n_experts).float()
        return Routing(indices, gates, keep, scores, aux_loss, z_loss)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """bias += rate * sign(mean load - load), mean-centred, from the load counted since the last call
        (summed over the ranks that route other tokens by `MoE.update_bias`, if any); then resets it."""
        rate = self.config.bias_update_rate
        load = self.tokens_per_expert
        if rate > 0 and load.sum() > 0:
            delta = rate * torch.sign(load.mean() - load)
            self.expert_bias += delta - delta.mean()
        load.zero_()


def local_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight as this rank uses it on its own tokens: a DTensor replicated over the ranks that split the
    tokens (tensor parallelism) gives its local copy, whose gradient is partial (summed over those ranks
    when FSDP redistributes it to the replicated layout); a plain tensor is itself."""
    if not hasattr(weight, "device_mesh"):  # duck-typed: importing DTensor costs a one-process run ~0.5 s
        return weight
    from torch.distributed.tensor import Partial

    return weight.to_local(grad_placements=[Partial()] * weight.device_mesh.ndim)


def pair_scores(scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The detached score (N, k) of each (token, choice) pair for its expert."""
    return scores.detach().gather(-1, indices)


def capacity_mask(
    indices: torch.Tensor, scores: torch.Tensor, capacity: int, n_experts: int, group: Any = None
) -> torch.Tensor:
    """keep (N, k): each expert keeps the `capacity` (token, choice) pairs with the highest score for it,
    among the pairs of every rank of `group` (ties: rank order, then token order), if given; `scores`
    (N, k) are the pairs' scores for their experts."""
    if group is not None:
        start, pairs = gather_rows(torch.cat([indices.to(scores.dtype), scores], 1), group)
        all_indices, all_scores = pairs.split(indices.shape[1], 1)
        keep = capacity_mask(all_indices.long(), all_scores, capacity, n_experts)
        return keep[start : start + indices.shape[0]]
    flat = indices.flatten()
    score = scores.flatten()
    by_score = torch.argsort(score, descending=True, stable=True)
    order = by_score[torch.argsort(flat[by_score], stable=True)]  # by expert, then by score descending
    counts = torch.bincount(flat, minlength=n_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep.view_as(indices)


def gather_rows(t: torch.Tensor, group: Any) -> tuple[int, torch.Tensor]:
    """(offset of this rank's rows, the rows (n_r, ...) of every rank of `group` in rank order)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = [t.new_zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, t.new_tensor([t.shape[0]], dtype=torch.long), group=group)
    n = [int(v) for v in torch.cat(sizes).tolist()]
    padded = t.new_zeros((max(n), *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)  # equal sizes: shards of a sequence may differ by one
    return sum(n[:rank]), torch.cat([part[:size] for part, size in zip(parts, n, strict=True)])


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes x (M, K) @ w (E, K, N): same float32/bfloat16/float16 dtype, at
    least one row, every non-unit stride a multiple of 16 bytes, and 16-byte aligned storage (on the CPU in
    torch 2.13 it raises otherwise; it also rejects float64 and int64 offsets)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype or x.dtype not in GROUPED_MM_DTYPES:
        return False
    if x.dim() != 2 or w.dim() != 3 or x.shape[0] == 0 or x.device.type not in ("cpu", "cuda"):
        return False
    for t in (x, w):
        if 1 not in t.stride() or t.data_ptr() % 16:
            return False
        if any(s != 1 and (s * t.element_size()) % 16 for s in t.stride()):
            return False
    return True


def _contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, use_grouped: bool = True
) -> torch.Tensor:
    """Rows of x in consecutive groups of `counts` rows, group e times w[e]: (M, K) @ (E, K, N) -> (M, N).

    One torch._grouped_mm where it applies (`grouped_mm_supported`), else a loop over the experts."""
    if use_grouped and grouped_mm_supported(x, w):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        y = torch._grouped_mm(x, w, offs=offsets)
        if y.requires_grad:  # its backward rejects an expanded (stride 0) gradient, e.g. of a .sum()
            y.register_hook(_contiguous_grad)
        return y
    return grouped_mm_loop(x, w, counts)


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The reference of `grouped_mm`: one matmul per expert (an expert with no rows contributes none)."""
    parts = [xe @ w[e] for e, xe in enumerate(torch.split(x, counts.tolist())) if xe.shape[0] > 0]
    if parts:
        return torch.cat(parts)
    # no rows (an expert-parallel rank that received none): an empty product that still gives every
    # weight (and x) a zero gradient, so every rank's FSDP reduces the same gradients
    return x @ w.sum(0)


class GroupedExperts(nn.Module):
    """E SwiGLU experts: w1, w3 (E, dim, ffn), w2 (E, ffn, dim); expert parallelism shards dim 0."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.use_grouped_mm = True

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, dim): rows sorted by expert, counts[e] of them for local expert e."""
        g = self.use_grouped_mm
        # expert parallelism shards the weights as DTensors on dim 0: compute with this rank's experts
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        device = x.device.type
        if torch.is_autocast_enabled(
            device
        ):  # torch._grouped_mm has no autocast rule: cast as a matmul would
            dtype = torch.get_autocast_dtype(device)
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        h = F.silu(grouped_mm(x, w1, counts, g)) * grouped_mm(x, w3, counts, g)
        return grouped_mm(h, w2, counts, g)


class SharedExperts(nn.Module):
    """n_shared SwiGLU experts applied to every token, as one SwiGLU of width n_shared * ffn (the same sum)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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
