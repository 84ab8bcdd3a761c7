"""ZeRO stage 1 on replicated parameters: the optimizer state of every parameter is split evenly over
the data-parallel ranks, element by element, so each rank holds 1/N of it (to within one element).

Each rank's optimizer steps a *view* of its slice of every parameter (the view shares the parameter's
storage, so the update lands in place); then the slices are all-gathered so every replica is whole
again. A checkpoint holds each rank's slices as they are (sharded_state_dict: no gather). Gradients stay full and identical on every rank (DDP's all-reduce), so clipping and logging
need nothing special. Chosen over torch's ZeroRedundancyOptimizer, which assigns whole parameters to
ranks: one large embedding then lands on one rank and the split is far from 1/N.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.checkpoint import CheckpointError
from trainer.core.dtensors import local_part

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


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
        # the slices' optimizer steps through the original's group dicts (their params now the slices): a
        # scheduler `configure_optimizers` built on the original sets the LR the slices' optimizer uses
        for original, sliced in zip(optimizer.param_groups, self.optimizer.param_groups, strict=True):
            original.update(sliced)
        self.optimizer.param_groups = optimizer.param_groups

    def whole(self) -> list[nn.Parameter]:
        """The whole parameters, in the optimizer's order (their `.grad` is the step's full gradient)."""
        return [p for p, *_ in self.entries]

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

    def sharded_state_dict(self, mesh: DeviceMesh) -> dict[str, Any]:
        """The optimizer's state with each rank's slices as DTensor shards of the flat full-size tensor
        (Shard(0) chunks are exactly these slices): DCP writes each rank's own, and reshards on load."""
        sd = self.optimizer.state_dict()
        state = {}
        for index, values in sd["state"].items():
            p, view, _, _ = self.entries[index]
            state[str(index)] = {
                k: self._as_shard(v, p, mesh) if self._is_slice(v, view) else v for k, v in values.items()
            }
        # a tuple: DCP stores it as one object (a list of dicts would be flattened key by key)
        return {"state": state, "param_groups": tuple(sd["param_groups"])}

    def load_sharded(self, saved: dict[str, Any], load: Any, mesh: DeviceMesh) -> None:
        """Fill this rank's slices from a checkpoint whose `saved` keys ({"optim.state.<i>.<name>":
        metadata}) say what is there; `load(payload)` reads it (DCP). Any world size can have written it."""
        state: dict[str, dict[str, Any]] = {}
        for key, meta in saved.items():
            parts = key.split(".")
            if parts[:2] != ["optim", "state"] or not hasattr(meta, "size"):
                continue
            index, name = parts[2], ".".join(parts[3:])
            if int(index) >= len(self.entries):
                raise CheckpointError(
                    f"the checkpoint holds optimizer state of parameter {index}; this optimizer has "
                    f"{len(self.entries)} parameters (another model?)"
                )
            p, view, _, _ = self.entries[int(index)]
            dtype = meta.properties.dtype
            if tuple(meta.size) == (p.numel(),):
                target = self._as_shard(torch.empty(view.shape, dtype=dtype, device=view.device), p, mesh)
            else:
                target = torch.empty(tuple(meta.size), dtype=dtype)
            state.setdefault(index, {})[name] = target
        payload = {"optim": {"state": state, "param_groups": None}}
        load(payload)
        loaded = payload["optim"]
        self.optimizer.load_state_dict(
            {
                "state": {
                    int(i): {k: local_part(v) for k, v in values.items()}
                    for i, values in loaded["state"].items()
                },
                "param_groups": list(loaded["param_groups"]),
            }
        )

    @staticmethod
    def _is_slice(value: Any, view: torch.Tensor) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == view.shape

    @staticmethod
    def _as_shard(local: torch.Tensor, p: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        from torch.distributed.tensor import DTensor, Shard  # only when checkpointing: ~0.4 s of start-up

        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(p.numel(),), stride=(1,))

    def load_full_state_dict(self, sd: dict[str, Any]) -> None:
        """Keep this rank's slice of each full-size state tensor (the format-1 checkpoints of ZeRO-1, which
        held the whole optimizer state in optimizer.pt)."""
        sliced = {"param_groups": sd["param_groups"], "state": {}}
        for index, state in sd["state"].items():
            p, view, lo, hi = self.entries[int(index)]
            sliced["state"][index] = {
                k: (v.reshape(-1)[lo:hi].clone() if isinstance(v, torch.Tensor) and v.shape == p.shape else v)
                for k, v in state.items()
            }
        self.optimizer.load_state_dict(sliced)
