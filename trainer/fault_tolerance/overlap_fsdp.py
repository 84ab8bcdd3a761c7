"""The cross-group gradient average overlapped with the backward for a replica group of several FSDP2 processes:
FSDP2's all-reduce hook (`FSDPModule.set_all_reduce_hook`) gets each unit's reduce-scatter output (this rank's
shard of the group's mean gradient; under HSDP, after the group's own all-reduce) as soon as the unit's
backward is done, and launches the sum of that shard over the replica groups (rank r with rank r of every
group: the same shard) while the backward runs on. The sharded `.grad` of the unit's parameters are views of
that buffer, so once `finish` waited they hold the average, with no copy. Where no norm is taken (no clipping),
the unit the backward reduces last, up to SUM_FIRST_ELEMENTS gradients, is summed over the groups whole
before the group's reduce-scatter, which then carries the group's commit vote: no round of the group's
own after the backward (bench/fault_tolerance.py --configs fsdp --group-size 2, width 16: the commit's
1.7 ms a step, mostly the wait for the group's slower process on 2 cores, down to 0.02)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed import ReduceOp
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from trainer.fault_tolerance.costs import StepCosts
from trainer.fault_tolerance.group_average import GroupAverage, Staged

# the last unit's gradients summed over the groups whole (g x its shard) so that the vote rides its
# reduce-scatter, up to this many elements: the copy and the larger sum cost ~8 ns an element here against
# the ~2 ms round they save (the bench's MLP of 0.5M parameters, one unit, ran 1.13x HSDP summed whole, 1.06-1.08x not)
SUM_FIRST_ELEMENTS = 1 << 17
# FSDP2's own reduce-scatter (torch 2.13 renamed it; reduce_scatter_tensor warns there)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class OverlappedShardAverage(GroupAverage):
    """All-reduce hooks on `module`'s FSDP2 units that sum each unit's gradient shard over the replica groups,
    scaled by 1 / groups in place first, while `arm`ed; the backward's last act is to wait for them (the
    loop scales `.grad` next: fp16's unscale, the token normalization). The units' hooks run on the
    backward's thread in the order the backward reaches them, the same in every group. With gradient accumulation FSDP reduce-scatters
    once, in the window's last backward (`set_requires_gradient_sync`); a unit reduced twice in a step (a
    second synced backward), or one whose shard FSDP goes on to divide or cast (see `_in_place`), marks the
    step stale: the caller averages after the backward instead. `vote_first` (no norm to carry the vote): the
    unit the previous backward reduced last is summed over the groups before its reduce-scatter, which sums
    `vote_terms` over the group with it (`voted`); every group must know that unit, so a quorum's first step
    averages after the backward (`layout_after_first_backward`)."""

    def __init__(
        self, module: nn.Module, direct: Any, costs: StepCosts | None = None, vote_first: bool = False
    ) -> None:
        from torch.distributed.fsdp import FSDPModule

        super().__init__([p for p in module.parameters() if p.requires_grad], direct, costs)
        self.units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        self.layout_after_first_backward = vote_first
        self.last_seen: int | None = None  # the unit the latest backward reduced last (its index)
        # the unit summed first's buffers (`reduce_scatter_with_vote`): its gradients, this process's shard
        self.staged: Staged | None = None
        self.mine: Staged | None = None
        for index, unit in enumerate(self.units):
            unit.set_all_reduce_hook(functools.partial(self._reduced, unit, index))
            if vote_first:
                unit.set_custom_reduce_scatter(_SumFirst(self, unit, index))
        self._reset()

    def _reset(self) -> None:
        """The step's units: none reduced (terms: as the backward ends, before its wait for their sums)."""
        self.stale = False
        self.reduced: set[int] = set()  # ids of the units whose shard went out this step
        self.works: list[Any] = []
        self.voted = None
        self.summed_first: int | None = None  # the unit summed whole before its reduce-scatter (its index)
        self.last = self.last_seen  # the unit this step's backward is expected to reduce last

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

    def _reduced(self, unit: nn.Module, index: int, shard: torch.Tensor) -> None:
        self.last_seen = index
        if not self.armed:
            return
        if index == self.summed_first:  # its reduce-scatter's output is the average already
            return
        self.voted = None  # a sum after the vote's (another order than learned): `commit` votes on its own
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

    def sums_first(self, unit: nn.Module, index: int, flat: torch.Tensor, op: Any) -> bool:
        """Whether `unit`'s reduce-scatter input `flat` is to be summed over the groups before it."""
        return (
            self.armed
            and not self.stale
            and self.vote_terms is not None
            and index == self.last
            and id(unit) not in self.reduced
            and flat.numel() <= SUM_FIRST_ELEMENTS
            and op in (ReduceOp.SUM, ReduceOp.AVG)
            # HSDP's all-reduce follows (looked up last: every unit's reduce-scatter asks)
            and not hasattr(unit._get_fsdp_state()._fsdp_param_groups[0].mesh_info, "replicate_process_group")
            and _in_place(unit, flat)
        )

    def reduce_scatter_with_vote(
        self, unit: nn.Module, index: int, output: torch.Tensor, flat: torch.Tensor, group: Any, op: Any
    ) -> None:
        """`flat` (the unit's gradients, every shard) x 1 / groups summed over the groups, quorum_every's
        terms with it; once every sum of the step is done, reduce-scattered over `group` with this process's
        vote terms after each shard: every process of the group gets its shard of the average and the
        group's summed vote. One staged copy, (processes, shard + 2), serves both."""
        self.reduced.add(id(unit))
        self.summed_first = index
        size, shard = group.size(), output.numel()
        staged = self.staged = Staged.kept(self.staged, size, shard, flat)
        mine = self.mine = Staged.kept(self.mine, 1, shard, flat)
        torch.mul(flat.view(size, shard), self.factor, out=staged.grads)
        riding = self.flags_ride(flat.dtype)
        if riding:
            staged.terms.copy_(self.terms)
        start = perf_counter()
        work = self.direct.allreduce(staged.whole, ReduceOp.SUM)
        self._wait()
        work.wait()  # a failure is recorded for `commit` (the terms vote against the step)
        self.costs.add("allreduce", start)  # (not hidden: the backward's last reduction waits for it)
        if riding:
            self.terms.copy_(staged.terms)
            self.terms_work = work
        self.take_flags()
        # every row's vote terms (what the sum over the groups left in their slots is not read)
        staged.slots.copy_(self.vote_terms())
        REDUCE_SCATTER(mine.flat, staged.flat, op=op, group=group)
        output.copy_(mine.first)
        # AVG divided the terms by the group's size too: whole counts again (a new tensor: `mine` is reused)
        self.voted = (mine.terms * size).round_() if op == ReduceOp.AVG else mine.terms.round()

    def _wait(self) -> None:
        for work in self.works:
            work.wait()  # a failure is recorded for `commit` (the step is discarded), never raised
        self.works = []


class _SumFirst(ReduceScatter):
    """FSDP2's reduce-scatter of one unit: the plain one, or (`sums_first`) after the sum over the groups."""

    def __init__(self, average: OverlappedShardAverage, unit: nn.Module, index: int) -> None:
        self.average, self.unit, self.index = average, unit, index

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh buffer, as FSDP2's own."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        """FSDP2's call (synchronous on the CPU, as FSDP2 makes it)."""
        if self.average.sums_first(self.unit, self.index, input_tensor, op):
            return self.average.reduce_scatter_with_vote(
                self.unit, self.index, output_tensor, input_tensor, group, op
            )
        return REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


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
