"""SyncBatchNorm: BatchNorm layers that normalise over the batch of every rank of a group (the ranks that
read different data), as Lightning's `sync_batchnorm=True` converts them before the model is wrapped, and
back after the fit.

On GPUs the layers become torch's `nn.SyncBatchNorm`, as under Lightning. torch's synchronises GPU inputs
only, and DDP refuses it around a CPU model, so CPU processes (gloo) get `CPUSyncBatchNorm`: the statistics
all-reduced with autograd-aware collectives in two passes (the mean, then the squared deviations from it,
which keeps the variance exact where E[x^2] - E[x]^2 would cancel), the backward all-reducing their
gradients as torch's GPU kernel does. Either way a job normalises as one process would on the whole batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_BatchNorm = nn.modules.batchnorm._BatchNorm
# on a converted layer: the BatchNorm class it had
_REPLACED = "_replaced_batchnorm"


class _SumOverGroup(torch.autograd.Function):
    """A sum over the group's ranks whose backward sums the gradients the same way: every rank's output
    depends on every rank's input."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class CPUSyncBatchNorm(_BatchNorm):
    """torch's SyncBatchNorm for CPU inputs: in training, the batch statistics of every rank of
    `process_group` (None: the world); in evaluation, or alone, a plain BatchNorm."""

    def __init__(self, *args: Any, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD if self.process_group is None else self.process_group
        # torch's rule: batch statistics in training mode, under a process group of more than one rank
        if not (self.training and dist.is_initialized() and dist.get_world_size(group) > 1):
            return super().forward(input)
        self._check_input_dim(input)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        channels = input.size(1)
        local = torch.cat([input.sum(dims), input.new_full((1,), input.numel() // channels)])
        total = _SumOverGroup.apply(local, group)
        count = total[-1]
        mean = total[:channels] / count
        centred = input - mean.view(shape)
        var = _SumOverGroup.apply(centred.square().sum(dims), group) / count
        self._track(mean.detach(), var.detach(), count.detach())
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape)
        if self.bias is not None:
            out = out + self.bias.view(shape)
        return out

    @torch.no_grad()
    def _track(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        """The running statistics, as F.batch_norm updates them (the variance unbiased over the global batch)."""
        if not self.track_running_stats or self.running_mean is None:
            return
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        unbiased = var * count / (count - 1).clamp(min=1)
        self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)


def convert_sync_batchnorm(module: nn.Module, process_group: Any, device_type: str) -> int:
    """Make every BatchNorm layer inside `module` a synchronised one over `process_group` (torch's on a GPU,
    `CPUSyncBatchNorm` on the CPU); returns how many. Each layer changes its class in place, as torch's FSDP2
    does: its parameters, buffers and hooks stay, and so does every reference to it (a wrapper's, a sharding's)."""
    cls = nn.SyncBatchNorm if device_type == "cuda" else CPUSyncBatchNorm
    layers = [m for m in module.modules() if isinstance(m, _BatchNorm) and not _synchronised(m)]
    for layer in layers:
        layer.__dict__[_REPLACED] = type(layer)
        layer.__class__ = cls
        layer.process_group = process_group
    return len(layers)


def revert_sync_batchnorm(module: nn.Module) -> None:
    """Give the layers `convert_sync_batchnorm` changed their own class back."""
    for layer in module.modules():
        original = layer.__dict__.pop(_REPLACED, None)
        if original is not None and _synchronised(layer):
            layer.__class__ = original
            del layer.process_group


def _synchronised(module: nn.Module) -> bool:
    return type(module) in (nn.SyncBatchNorm, CPUSyncBatchNorm)
