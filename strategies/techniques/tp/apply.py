"""Tensor (and sequence) parallelism: the model's own DTensor plan (`tensor_parallel_plan`) over the
"tp" mesh."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def apply_tp(module: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Parallelize `module` by its plan: `sequence_parallel` shards the activations between blocks over
    the tp ranks, `loss_parallel` keeps the logits vocabulary-sharded for the loss."""
    from torch.distributed.tensor.parallel import parallelize_module  # DTensor: only a tp run imports it

    parallelize_module(module, mesh, module.tensor_parallel_plan(sequence_parallel, loss_parallel))


def quiet_norm_reduction() -> None:
    """Silence DTensor's (once per rank) warning that reducing the gradient norm over a 2-D mesh takes two
    all-reduces of one scalar each; that is what the clipping norm costs, and it is negligible."""
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_not_the_norms_reduction)


def _not_the_norms_reduction(record: logging.LogRecord) -> bool:
    return "_NormPartial" not in str(record.args)
