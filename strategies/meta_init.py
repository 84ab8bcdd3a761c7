"""Materialise a model that was built on `meta` and sharded, one parameter at a time, with exactly the
values a non-sharded init would give for the same seed.

The model's own `init_weights()` runs on the sharded parameters. Deterministic init ops (ones_, zeros_,
copy_) act on each rank's shard directly. A random in-place op on a sharded DTensor instead draws the
*full* tensor with the same call, consuming the RNG exactly as the unsharded init does, and keeps this
rank's shard: the peak extra memory is one parameter, never the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from trainer.core.dtensors import is_dtensor

_RANDOM_INPLACE = {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.bernoulli_,
    torch.Tensor.exponential_,
    torch.Tensor.random_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.geometric_,
    # torch.nn.init dispatches these itself (before reaching the Tensor methods above)
    nn.init.normal_,
    nn.init.uniform_,
    nn.init.trunc_normal_,
    nn.init.kaiming_normal_,
    nn.init.kaiming_uniform_,
    nn.init.xavier_normal_,
    nn.init.xavier_uniform_,
    nn.init.orthogonal_,
    nn.init.sparse_,
}


class FullShapeRandomInit(TorchFunctionMode):
    """Within this mode, random in-place init of a DTensor equals init of the full tensor, then sharding."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        target = args[0] if args else kwargs.get("tensor")
        if func not in _RANDOM_INPLACE or not is_dtensor(target):
            return func(*args, **kwargs)
        local = target.to_local()
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        if args:
            func(full, *args[1:], **kwargs)  # the same draws, in the same order, as a non-sharded init
        else:
            func(**{**kwargs, "tensor": full})
        from torch.distributed.tensor import distribute_tensor  # loaded: `target` is a DTensor

        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        local.copy_(shard.to_local())
        return target


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate the meta parameters of `module` on `device` and run its `init_weights()`."""
    init = getattr(module, "init_weights", None)
    if not callable(init):
        raise AttributeError(
            f"{type(module).__name__} was built on the meta device but has no init_weights(); define it to "
            "initialise parameters (and buffers) in place"
        )
    module.to_empty(device=device)
    with torch.no_grad(), FullShapeRandomInit():
        init()
