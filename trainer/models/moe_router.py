"""The MoE router: top-k experts, gates, capacity, auxiliary losses and the balancing bias."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.core.moe_dispatch import Routing
from trainer.models.moe_config import MoEConfig


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
