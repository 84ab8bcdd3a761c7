"""Pipeline parallelism: cut a model into stages at block boundaries (the schedule that runs them over
the micro-batches of a batch: schedule.py).

A model declares `pipeline_layout()`: the modules before its blocks, the ModuleDict of blocks and the
modules after them. Each rank keeps one model holding the union of its stages' parts (state-dict keys
are the full model's, so checkpoints load under any pp degree) and, per stage, a *view*: a shallow
copy that shares those parts and holds only the stage's own, whose forward is the model's forward on
the parts present.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, TypeVar

from torch import nn

# stages per rank of each schedule: looped schedules hold `pp` apart stages, "V" ones fold back
SCHEDULES = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "LoopedBFS": 2,
    "InterleavedZeroBubble": 2,
    "ZBVZeroBubble": 2,
}
V_SHAPED = ("ZBVZeroBubble",)
# schedules that split the backward into input- and weight-gradient passes
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


def check_schedule(name: str) -> str:
    """`name` if it is a schedule this strategy runs; a one-line ValueError listing them otherwise."""
    if name not in SCHEDULES:
        raise ValueError(f"pp_schedule={name!r} is unknown; allowed: {', '.join(SCHEDULES)}")
    return name


def stage_ids(schedule: str, pp_rank: int, pp: int) -> list[int]:
    """The stages rank `pp_rank` of `pp` holds: r (single), r, r+pp, ... (looped) or r, 2pp-1-r (V)."""
    per_rank = SCHEDULES[schedule]
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


_Block = TypeVar("_Block")


def split_blocks(
    names: list[_Block], n_stages: int, per_stage: list[int] | None = None
) -> list[list[_Block]]:
    """The blocks of each stage, in order. Balanced: the modules before and after the blocks weigh one
    block each (TorchTitan's rule), so the first and last stages get a block less where that evens
    the load; every stage keeps at least one block. `per_stage` gives the counts explicitly."""
    if per_stage is None:
        units = len(names) + 2  # the embedding and the output count like blocks
        ends = [round((i + 1) * units / n_stages) for i in range(n_stages)]
        # unit 0 is the embedding: stage i's blocks end at unit ends[i], so block count = unit - 1
        bounds = [0] + [min(max(e - 1, 0), len(names)) for e in ends[:-1]] + [len(names)]
        per_stage = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        if min(per_stage) < 1:  # weighting would leave a stage with no block: split the blocks evenly
            base, extra = divmod(len(names), n_stages)
            per_stage = [base + (i < extra) for i in range(n_stages)]
    starts = [0, *itertools.accumulate(per_stage)][:-1]
    return [names[s : s + n] for s, n in zip(starts, per_stage, strict=True)]


def check_layers_per_stage(per_stage: Any, n_stages: int, n_blocks: int) -> None:
    """A one-line ValueError unless `per_stage` is `n_stages` ints >= 1 summing to `n_blocks`."""
    if (
        not isinstance(per_stage, (list, tuple))
        or len(per_stage) != n_stages
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in per_stage)
        or sum(per_stage) != n_blocks
    ):
        raise ValueError(
            f"pp_layers_per_stage={per_stage!r} does not fit {n_stages} stages of {n_blocks} blocks; allowed: "
            f"{n_stages} ints >= 1 summing to {n_blocks}"
        )


def prune(model: nn.Module, mine: list[list[str]], first: bool, last: bool) -> None:
    """Keep in `model` only the parts of this rank's stages (`mine`: their block names)."""
    before, blocks_name, after = model.pipeline_layout()
    blocks = getattr(model, blocks_name)
    keep = {name for stage in mine for name in stage}
    for name in list(blocks):
        if name not in keep:
            del blocks[name]
    for name in before if not first else ():
        setattr(model, name, None)
    for name in after if not last else ():
        setattr(model, name, None)


def stage_view(model: nn.Module, block_names: list[str], first: bool, last: bool) -> nn.Module:
    """A module that shares `model`'s parts and holds only one stage's: a shallow copy whose module,
    parameter, buffer and hook tables are its own, so wrapping it (FSDP) leaves `model` as it is."""
    view = copy.copy(model)
    view.__dict__ = {k: copy.copy(v) if isinstance(v, (dict, set)) else v for k, v in model.__dict__.items()}
    before, blocks_name, after = model.pipeline_layout()
    blocks = getattr(model, blocks_name)
    setattr(view, blocks_name, nn.ModuleDict({name: blocks[name] for name in block_names}))
    for name in before if not first else ():
        setattr(view, name, None)
    for name in after if not last else ():
        setattr(view, name, None)
    return view
