"""Expert parallelism (TorchTitan's): each rank of an "ep" group holds E/ep of a MoE layer's experts and
receives, by an all-to-all, the (token, choice) pairs routed to them from every rank of the group.

- `AllToAllDispatcher` is the `MoE.dispatcher` seam (trainer/core/moe_dispatch.py): dispatch sorts
  this rank's kept pairs by global expert id (as `LocalDispatcher`), exchanges the per-expert counts, sends each
  rank the rows of its experts (variable splits, autograd-aware), and regroups what arrives by local
  expert so `compute` sees contiguous rows per local expert; combine is the exact reverse.
- `shard_experts` makes the routed experts' 3-D weights DTensors `Shard(0)` on the "ep" mesh (the
  compute uses their local E/ep experts), so FSDP2, DCP and the DTensor gradient norm handle them as
  any other sharded parameter.

apply.py applies both to the model's `expert_modules()` (experts.py); no model is imported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.core.moe_dispatch import LocalDispatcher, Routing


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Rows x[in_splits[i] rows] go to rank i of `group`; returns the rows received, out_splits[i] from
    rank i, in rank order. Differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatcher(LocalDispatcher):
    """Dispatch to / combine from the experts' owners in `group` (ep ranks; rank r owns the contiguous
    experts r*E/ep .. (r+1)*E/ep - 1, i.e. Shard(0) of the expert weights).

    dispatch -> (tokens (M', dim) grouped by local expert, counts (E/ep,), ctx). `empty_chunks` counts
    the (source rank, expert) pairs that sent no rows (uneven routing), for tests and logging.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.empty_chunks = 0

    def dispatch(
        self, x: torch.Tensor, routing: Routing, n_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        if n_experts % self.ep:
            raise ValueError(f"n_experts={n_experts} is not divisible by ep={self.ep}")
        tokens, counts, local_ctx = super().dispatch(x, routing, n_experts)  # sorted by global expert
        n_local = n_experts // self.ep
        # recv_counts[s, l]: rows rank s sends for this rank's local expert l
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)
        recv_counts = recv_counts.view(self.ep, n_local)
        in_splits = counts.view(self.ep, n_local).sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        received = all_to_all(tokens, out_splits, in_splits, self.group)  # by source, then local expert
        chunk = torch.repeat_interleave(
            torch.arange(self.ep * n_local, device=x.device), recv_counts.flatten().to(x.device)
        )
        perm = torch.argsort((chunk % n_local) * self.ep + chunk // n_local, stable=True)  # by local expert
        self.empty_chunks += int((recv_counts == 0).sum())
        ctx = (local_ctx, counts, perm, in_splits, out_splits)
        return received[perm], recv_counts.sum(0), ctx

    def combine(self, out: torch.Tensor, routing: Routing, ctx: Any) -> torch.Tensor:
        local_ctx, _, perm, in_splits, out_splits = ctx
        by_source = out[torch.argsort(perm)]  # undo the regrouping
        back = all_to_all(by_source, in_splits, out_splits, self.group)  # this rank's pairs, by global expert
        return super().combine(back, routing, local_ctx)

    def load(self, counts: torch.Tensor, ctx: Any) -> torch.Tensor:
        """This rank's kept pairs per global expert (E,), as `LocalDispatcher` reports them."""
        return ctx[1]


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """w1, w2, w3 become DTensors Shard(0) on the 1-D `mesh` (this rank keeps its E/ep experts), sliced
    locally from the full tensor (identical on every rank, or meta before materialisation)."""
    from torch.distributed.tensor import Shard, distribute_tensor  # ~0.4 s of start-up: only an ep run

    for name, param in list(experts.named_parameters(recurse=False)):
        if param.shape[0] % mesh.size():
            raise ValueError(f"{param.shape[0]} experts are not divisible by ep={mesh.size()}")
        sharded = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
