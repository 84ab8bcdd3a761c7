"""Data parallel by replication: DistributedDataParallel over the batch group, with an optional
gradient-compression comm hook."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from strategies.techniques.ddp.chain import ChainableHook

COMPRESSION = (None, "fp16", "bf16", "powersgd")


class StepRunner(nn.Module):
    """Holds the user's module; its forward runs one of the module's `*_step` methods. A wrapper that
    hooks `forward` (DDP) wraps this, so the step runs inside the wrapper's forward while `self(x)` in the
    step still reaches the module's own forward (Lightning's wrapper works the same way)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, method: str, *args: Any) -> Any:
        return getattr(self.module, method)(*args)


def check_compression(value: Any) -> str | None:
    """`value` if DDP's comm hooks know it; a one-line ValueError otherwise."""
    if value not in COMPRESSION:
        raise ValueError(
            f"gradient_compression={value!r} is unknown; allowed: None, 'fp16', 'bf16', 'powersgd'"
        )
    return value


def apply_ddp(
    module: nn.Module,
    group: Any,
    device: torch.device,
    ddp_kwargs: dict[str, Any],
    compression: str | None = None,
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 10,
    watch: Callable[[torch.Tensor], None] | None = None,
) -> DistributedDataParallel:
    """DDP over `group` around a StepRunner of `module` (the module itself is left unwrapped, so the
    Trainer and the user keep calling it); DDP's constructor broadcasts rank 0's parameters and buffers,
    so every replica starts equal. `watch` gets each bucket's squared norm before its all-reduce."""
    device_ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(
        StepRunner(module), device_ids=device_ids, process_group=group, **ddp_kwargs
    )
    _register_hook(model, group, compression, powersgd_rank, powersgd_start_iter, watch)
    return model


def prepare_for_backward(model: DistributedDataParallel, loss: torch.Tensor) -> None:
    """Arm DDP's gradient sync for a backward taken inside its forward (a manually optimized step, which may
    take several): DDP arms it once its forward returns, for the one backward that follows. With
    `find_unused_parameters`, the parameters `loss` does not reach (another optimizer's, switched off by
    `toggle_optimizer`) are marked ready at once, so the sync does not wait for them. Under `no_sync` nothing
    is armed: the gradients stay on each rank."""
    if not (torch.is_grad_enabled() and model.require_backward_grad_sync):
        return
    model.require_forward_param_sync = True
    reducer = model.reducer
    # closes the previous backward's bucket bookkeeping (DDP does it at each forward); DDP raises when that
    # backward left parameters unreduced
    try:
        reducer._rebuild_buckets()
    except RuntimeError as err:
        if "finished reduction in the prior iteration" not in str(err):
            raise
        raise RuntimeError(
            "a backward of this manually optimized step reached only some parameters (those of the optimizer "
            "`toggle_optimizer` left on, or a detached part), so DDP's gradient sync waits for the rest; "
            "allowed: DDPStrategy(find_unused_parameters=True)"
        ) from None
    reducer.prepare_for_backward([loss] if model.find_unused_parameters and not model.static_graph else [])


def _register_hook(
    model: DistributedDataParallel,
    group: Any,
    compression: str | None,
    rank: int,
    start_iter: int,
    watch: Callable[[torch.Tensor], None] | None,
) -> None:
    """The one comm hook DDP allows: the compression's (None: DDP's built-in all-reduce, or, when
    watched, the same all-reduce as a Python hook), run after `watch` reads the bucket; a `ChainableHook`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    state: Any = group
    hook: Any = None if watch is None else default_hooks.allreduce_hook
    if compression == "fp16":
        hook = default_hooks.fp16_compress_hook
    elif compression == "bf16":
        hook = default_hooks.bf16_compress_hook
    elif compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,  # PowerSGD's own all-reduces: over DDP's replicas only
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter,
        )
        hook = powerSGD_hook.powerSGD_hook
    if hook is not None:  # chainable: fault tolerance sums each bucket over the replica groups after it
        model.register_comm_hook(state, ChainableHook(hook if watch is None else _watched(hook, watch)))


def _watched(hook: Any, watch: Callable[[torch.Tensor], None]) -> Any:
    """`hook` after `watch(squared norm of the bucket)`: read first, as the all-reduce divides the bucket in
    place (on a GPU the norm is queued before it on the same stream). It keeps `hook`'s name and signature,
    which DDP checks and logs."""

    @functools.wraps(hook)
    def watched(state: Any, bucket: Any) -> Any:
        watch(torch.linalg.vector_norm(bucket.buffer(), dtype=torch.float32).square())
        return hook(state, bucket)

    return watched
