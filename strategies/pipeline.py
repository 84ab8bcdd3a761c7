"""Pipeline parallelism: cut a model into stages at block boundaries and run one schedule of
`torch.distributed.pipelining` over the micro-batches of a batch.

A model declares `pipeline_layout()`: the modules before its blocks, the ModuleDict of blocks and the
modules after them. Each rank keeps one model holding the union of its stages' parts (state-dict keys
are the full model's, so checkpoints load under any pp degree) and, per stage, a *view*: a shallow
copy that shares those parts and holds only the stage's own, whose forward is the model's forward on
the parts present.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from strategies.base import StepOutput, combine_micro_batches, unpack_loss

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


def split_blocks(names: list[str], n_stages: int, per_stage: list[int] | None = None) -> list[list[str]]:
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
    starts = [sum(per_stage[:i]) for i in range(n_stages)]
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


class _Stage(PipelineStage):
    """A PipelineStage whose metadata inference leaves the model's buffers as they were: the schedule runs
    it (on its first step, and again after switching between training and evaluation) as a forward of
    the stage on placeholder inputs, uninitialised past the first stage, whose effect on buffers (a MoE
    router's load count, running statistics) would otherwise join the next real step's."""

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        saved = [(b, b.detach().clone()) for b in self.submod.buffers()]
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            with torch.no_grad():  # only what changed: a buffer the backward inference reads (RoPE) stays
                for buffer, value in saved:
                    if not torch.equal(buffer, value):
                        buffer.copy_(value)


class Pipeline:
    """This rank's stages and the schedule that runs them; `step` does one batch's forward+backward."""

    def __init__(
        self,
        views: list[nn.Module],
        ids: list[int],
        n_stages: int,
        schedule: str,
        microbatches: int,
        group: dist.ProcessGroup,
        device: torch.device,
        loss: Callable[[Any, Any], Any],
    ) -> None:
        self.stages = [
            _Stage(view, i, n_stages, device, group=group) for view, i in zip(views, ids, strict=True)
        ]
        self.group, self.microbatches, self.loss = group, microbatches, loss
        self.is_first, self.is_last = 0 in ids, n_stages - 1 in ids
        cls = get_schedule_class(schedule)
        stages: Any = self.stages if issubclass(cls, PipelineScheduleMulti) else self.stages[0]
        # scale_grads=False: the loss function weights each micro-batch itself (tokens, or 1/m)
        self.schedule = cls(stages, microbatches, loss_fn=self._loss, scale_grads=False)
        self._outputs: list[StepOutput] = []
        self._weight = 1.0

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        loss, num_tokens = unpack_loss(self.loss(output, target), "pipeline_loss")
        self._outputs.append(StepOutput(loss.detach(), num_tokens))
        if num_tokens is not None:
            return loss * num_tokens
        # the schedule sums the m micro-batches' gradients: each mean loss weighs 1/m of the batch's
        return loss * (self._weight / self.microbatches)

    def step(self, inputs: torch.Tensor, target: torch.Tensor, weight: float) -> StepOutput:
        """Forward+backward of one batch, split into the micro-batches; a loss without a token count is
        scaled by `weight` (1 / accumulated batches) / micro-batches. The loss is the last stage's, sent
        to every stage."""
        return self._run(self.schedule.step, inputs, target, weight)

    def evaluate(self, inputs: torch.Tensor, target: torch.Tensor) -> StepOutput:
        """Forward only of one batch (validation/test): the loss of the last stage, on every stage."""
        return self._run(self.schedule.eval, inputs, target, 1.0)

    def _run(
        self, run: Callable[..., Any], inputs: torch.Tensor, target: torch.Tensor, weight: float
    ) -> StepOutput:
        self._outputs, self._weight = [], weight
        args = (inputs,) if self.is_first else ()
        run(*args, target=target if self.is_last else None, return_outputs=False)
        packed = torch.zeros(3, device=inputs.device)  # loss, token count, whether counted
        if self.is_last:
            # the first step's shape inference computes a loss too (no backward): keep the schedule's own
            out = combine_micro_batches(self._outputs[-self.microbatches :])
            counted = out.num_tokens is not None
            packed[0], packed[2] = out.loss.float(), float(counted)
            packed[1] = out.num_tokens.float() if counted else 1.0
        dist.all_reduce(packed, group=self.group)  # only the last stage's is non-zero
        loss, num_tokens, counted = packed
        return StepOutput(loss, num_tokens if counted else None)
