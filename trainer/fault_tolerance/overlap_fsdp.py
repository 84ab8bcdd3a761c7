"""The cross-group gradient average overlapped with the backward for a replica group of several FSDP2 processes:
FSDP2's all-reduce hook (`FSDPModule.set_all_reduce_hook`) gets each unit's reduce-scatter output (this rank's
shard of the group's mean gradient; under HSDP, after the group's own all-reduce) as soon as the unit's
backward is done, and launches the sum of that shard over the replica groups (rank r with rank r of every
group: the same shard) while the backward runs on. The sharded `.grad` of the unit's parameters are views of
that buffer, so once `finish` waited they hold the average, with no copy."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed import ReduceOp

from trainer.fault_tolerance.costs import StepCosts
from trainer.fault_tolerance.group_average import GroupAverage


class OverlappedShardAverage(GroupAverage):
    """All-reduce hooks on `module`'s FSDP2 units that sum each unit's gradient shard over the replica groups,
    scaled by 1 / groups in place first, while `arm`ed; the backward's last act is to wait for them (the
    loop scales `.grad` next: fp16's unscale, the token normalization). The units' hooks run on the
    backward's thread in the order the backward reaches them, the same in every group. With gradient accumulation FSDP reduce-scatters
    once, in the window's last backward (`set_requires_gradient_sync`); a unit reduced twice in a step (a
    second synced backward), or one whose shard FSDP goes on to divide or cast (see `_in_place`), marks the
    step stale: the caller averages after the backward instead."""

    def __init__(self, module: nn.Module, direct: Any, costs: StepCosts | None = None) -> None:
        from torch.distributed.fsdp import FSDPModule

        super().__init__([p for p in module.parameters() if p.requires_grad], direct, costs)
        self.units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for unit in self.units:
            unit.set_all_reduce_hook(functools.partial(self._reduced, unit))
        self._reset()

    def _reset(self) -> None:
        """The step's units: none reduced (terms: as the backward ends, before its wait for their sums)."""
        self.stale = False
        self.reduced: set[int] = set()  # ids of the units whose shard went out this step
        self.works: list[Any] = []

    def _complete(self) -> bool:
        """A unit reduced, none twice or divided or cast after its hook."""
        return bool(self.reduced) and not self.stale

    @property
    def launched(self) -> int:
        """The sums over the groups this step's backward launched (one per unit)."""
        return len(self.reduced)

    def remove(self) -> None:
        """Disarm the hooks (FSDP2 has no call to take one off; unarmed, they do nothing)."""
        self.armed = False

    def _reduced(self, unit: nn.Module, shard: torch.Tensor) -> None:
        if not self.armed:
            return
        if id(unit) in self.reduced or not _in_place(unit, shard):
            # FSDP adds to, divides or casts the shard as soon as this returns: nothing may be in flight on it
            self._wait()
            self.stale = True
            return
        if not self.reduced:  # the backward ends by waiting for the sums, before anything scales `.grad`
            Variable._execution_engine.queue_callback(self._backward_done)
        self.reduced.add(id(unit))
        if self.factor != 1.0:
            shard.mul_(self.factor)
        self.works.append(self.direct.allreduce(shard, ReduceOp.SUM))

    def _backward_done(self) -> None:
        self.send_terms()
        self._wait()

    def _wait(self) -> None:
        for work in self.works:
            work.wait()  # a failure is recorded for `commit` (the step is discarded), never raised
        self.works = []


def _in_place(unit: nn.Module, shard: torch.Tensor) -> bool:
    """Whether FSDP2 (torch 2.13's `foreach_reduce`) only takes views of `shard` after the hook: no division
    after it (a forced-sum reduction divides there), no cast to the parameters' dtype (a reduce dtype of its
    own), no copy to the host (CPU offload of GPU gradients). FSDP keeps these on its private param group."""
    for group in unit._get_fsdp_state()._fsdp_param_groups:
        # a reduce dtype of None: the gradients' own
        if group.force_sum_reduction_for_comms or group._reduce_dtype not in (None, group._orig_dtype):
            return False
        if shard.device.type != "cpu" and any(p.offload_to_cpu for p in group.fsdp_params):
            return False
    return True


def fsdp_units(trainer: Any) -> bool:
    """Whether every trainable parameter is sharded by an FSDP2 unit of one param group (the all-reduce hook
    is per unit, for one group) and no pipeline splits the model."""
    from torch.distributed.fsdp import FSDPModule

    module, strategy = trainer.module, trainer.strategy
    if getattr(strategy, "pipeline", None) is not None or getattr(strategy, "pp", 1) > 1:
        return False
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    covered: set[int] = set()
    for unit in units:
        groups = unit._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            return False
        covered.update(id(p.sharded_param) for g in groups for p in g.fsdp_params)
    return bool(units) and all(id(p) in covered for p in module.parameters() if p.requires_grad)
