"""One autocast copy of an activation that several linears read (q, k, v of the attention norm's output;
w1, w3 of the feed-forward norm's), instead of one per linear.

Autocast caches its casts of weights only: an fp32 activation fed to three linears is cast three times, and
each linear keeps its own copy for the backward (measured on the tiny Llama under bf16: 3 + 2 bf16 copies of
the norm outputs, a quarter of what a block keeps). `shared_cast` casts once and hands each linear an alias of
that copy, so autograd keeps one storage. Numerics are the autocast's: the same forward values, and each
linear's gradient is cast back to fp32 before they are summed, as autocast's own per-linear casts do.
"""

from __future__ import annotations

from typing import Any

import torch


def shared_cast(x: torch.Tensor, consumers: int) -> tuple[torch.Tensor, ...]:
    """`consumers` aliases of `x` in the autocast dtype when autocast would cast it, else `x` itself each
    time (fp32 runs, bf16 weights, or an input already in the autocast dtype)."""
    device = x.device.type
    if not (x.is_floating_point() and torch.is_autocast_enabled(device)):
        return (x,) * consumers
    dtype = torch.get_autocast_dtype(device)
    if x.dtype == dtype:
        return (x,) * consumers
    return _SharedCast.apply(x, dtype, consumers)


class _SharedCast(torch.autograd.Function):
    """Forward: one cast, returned as `consumers` aliases (one storage kept by whoever saves them).
    Backward: each alias's gradient cast to the input's dtype, then summed there (not in the low dtype)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dtype: torch.dtype, consumers: int) -> tuple[torch.Tensor, ...]:
        ctx.dtype = x.dtype
        low = x.to(dtype)
        return tuple(low.view_as(low) for _ in range(consumers))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # summed as autograd sums the gradients of a tensor read several times: the last reader's first (its
        # backward runs first), so the result is bit for bit the per-linear casts'
        total = grads[-1].to(ctx.dtype)
        for g in reversed(grads[:-1]):  # an unused alias's gradient comes as zeros (materialised)
            total = total + g.to(ctx.dtype)
        return total, None, None
