"""ZeRO stage 1 on replicated parameters: the optimizer state of every parameter is split evenly over
the data-parallel ranks, element by element, so each rank holds 1/N of it (to within one element).

Each rank's optimizer steps a *view* of its slice of every parameter (the view shares the parameter's
storage, so the update lands in place); then the slices are all-gathered so every replica is whole
again. Gradients stay full and identical on every rank (DDP's all-reduce), so clipping and logging
need nothing special. Chosen over torch's ZeroRedundancyOptimizer, which assigns whole parameters to
ranks: one large embedding then lands on one rank and the split is far from 1/N.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class SlicedParameters:
    """The (parameter, slice view, start, end) of this rank for every parameter of an optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, rank: int, size: int, group: Any) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.entries: list[tuple[nn.Parameter, nn.Parameter, int, int]] = []
        groups = []
        for g in optimizer.param_groups:
            views = []
            for p in g["params"]:
                chunk = -(-p.numel() // size)
                lo, hi = min(rank * chunk, p.numel()), min((rank + 1) * chunk, p.numel())
                view = nn.Parameter(p.detach().view(-1)[lo:hi], requires_grad=p.requires_grad)
                self.entries.append((p, view, lo, hi))
                views.append(view)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": views})
        accepted = inspect.signature(type(optimizer)).parameters  # defaults may hold more than __init__ takes
        self.optimizer = type(optimizer)(
            groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted}
        )

    def attach_gradients(self) -> None:
        """Point each slice's .grad at its part of the full (all-reduced) gradient: no copy."""
        for p, view, lo, hi in self.entries:
            view.grad = None if p.grad is None else p.grad.view(-1)[lo:hi]

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Every rank updated its slices in place; all-gather them so each replica is whole again."""
        for p, _, _, _ in self.entries:
            p.view(-1).copy_(self._gather(p.detach().view(-1), p.numel()))
            p.grad = None  # the full gradient was consumed; the Trainer's zero_grad only sees the slices

    def _gather(self, flat: torch.Tensor, numel: int) -> torch.Tensor:
        chunk = -(-numel // self.size)
        lo, hi = min(self.rank * chunk, numel), min((self.rank + 1) * chunk, numel)
        mine = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
        mine[: hi - lo] = flat[lo:hi]
        out = torch.empty(chunk * self.size, dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        return out[:numel]

    def full_state_dict(self) -> dict[str, Any]:
        """The optimizer's state as if it were not sharded (full-size tensors): any world size can load it."""
        sd = self.optimizer.state_dict()
        for index, (p, view, lo, hi) in enumerate(self.entries):
            if index not in sd["state"]:
                continue
            # a copy: state_dict() hands out the optimizer's own per-parameter dicts, and a full-size tensor
            # written into them would replace the slice the next step updates
            state = sd["state"][index] = dict(sd["state"][index])
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == view.shape and value.dim() == 1:
                    padded = torch.zeros(p.numel(), dtype=value.dtype, device=value.device)
                    padded[lo:hi] = value
                    state[key] = self._gather(padded, p.numel()).view_as(p)
        return sd

    def load_full_state_dict(self, sd: dict[str, Any]) -> None:
        """Keep this rank's slice of each full-size state tensor."""
        sliced = {"param_groups": sd["param_groups"], "state": {}}
        for index, state in sd["state"].items():
            p, view, lo, hi = self.entries[int(index)]
            sliced["state"][index] = {
                k: (v.reshape(-1)[lo:hi].clone() if isinstance(v, torch.Tensor) and v.shape == p.shape else v)
                for k, v in state.items()
            }
        self.optimizer.load_state_dict(sliced)
