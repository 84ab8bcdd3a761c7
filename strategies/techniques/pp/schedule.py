"""The schedule that runs this rank's pipeline stages (`torch.distributed.pipelining`), apart from the
stage cutting in stages.py: importing torch's pipelining imports torch._dynamo (half a second of every
process's start-up), so only a run with pp > 1 imports this module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from strategies.step_output import StepOutput, combine_micro_batches, unpack_loss


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
