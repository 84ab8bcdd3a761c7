"""Which overlapped cross-group average fits a replica group of several processes: DDP's comm hook chained
(overlap_ddp.py) or FSDP2's all-reduce hook (overlap_fsdp.py); None leaves the average after the backward."""

from __future__ import annotations

from typing import Any

from trainer.fault_tolerance.costs import StepCosts
from trainer.fault_tolerance.overlap_ddp import OverlappedGroupAverage, ddp_to_chain
from trainer.fault_tolerance.overlap_fsdp import OverlappedShardAverage, fsdp_units


def overlap_in_group(
    trainer: Any, direct: Any, costs: StepCosts
) -> OverlappedGroupAverage | OverlappedShardAverage | None:
    """The hooks that launch the sum over the groups of `trainer`'s gradients from the backward, after the
    group's own reduction (each group runs the same configuration: every group gets the same answer), or None."""
    if not overlap_fits_group(trainer):
        return None
    ddp = ddp_to_chain(trainer)
    if ddp is not None:
        return OverlappedGroupAverage(ddp, direct, costs)
    # without clipping no norm's all-reduce over the group follows the sums to carry the commit vote
    return OverlappedShardAverage(
        trainer.module, direct, costs, vote_first=trainer.flags.gradient_clip_val is None
    )


def overlap_fits_group(trainer: Any) -> bool:
    """Whether `overlap_in_group` gives `trainer`'s group of several processes an overlapped average."""
    return trainer.strategy.world_size > 1 and (ddp_to_chain(trainer) is not None or fsdp_units(trainer))
