"""Numeric precision of a run: autocast for the forward, a gradient scaler for fp16, or bf16 weights."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.core.tree import apply_to_tensors

PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-true")
_ALIASES = {"32-true": "32", "fp32": "32", "16": "16-mixed", "bf16": "bf16-mixed"}
# a context that does nothing; stateless and reentrant, so one serves every step (not one made per call)
NO_CONTEXT = contextlib.nullcontext()


class Precision:
    """One of `PRECISIONS`: "32" fp32; "bf16-mixed"/"16-mixed" fp32 weights with a bf16/fp16 autocast
    forward ("16-mixed" adds a dynamic gradient scaler against fp16 underflow); "bf16-true" bf16 weights."""

    def __init__(self, precision: str | int, device_type: str = "cpu") -> None:
        name = _ALIASES.get(str(precision), str(precision))
        if name not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is unknown; allowed: {', '.join(PRECISIONS)}")
        self.name = name
        self.converts_input = name == "bf16-true"  # (read every step: `convert_input` is a no-op otherwise)
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler(device_type) if name == "16-mixed" else None
        self.settled = False  # the scaler's start is chosen: a backward ran, or a checkpoint's scale loaded
        self.autocast_forward = name in (
            "bf16-mixed",
            "16-mixed",
        )  # off when a strategy casts parameters itself

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast weights for "bf16-true"; the mixed modes keep fp32 master weights."""
        return module.to(torch.bfloat16) if self.name == "bf16-true" else module

    def convert_input(self, batch: Any) -> Any:
        """Floating-point inputs in bf16 for "bf16-true" (its weights are bf16); unchanged otherwise."""
        if self.name != "bf16-true":
            return batch
        return apply_to_tensors(batch, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward pass runs in."""
        if self.autocast_forward:
            dtype = torch.bfloat16 if self.name == "bf16-mixed" else torch.float16
            return torch.autocast(self.device_type, dtype=dtype)
        return NO_CONTEXT

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """`loss.backward(*args, **kwargs)`, of the loss scaled by fp16's scaler."""
        (self.scaler.scale(loss) if self.scaler else loss).backward(*args, **kwargs)

    def settle_scale(self, weight: Any, largest: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Once, before a fresh run's first backward, of the loss x `weight`. Where that is a token sum (`weight`
        a token count, a tensor; `largest` gives its maximum over the ranks), fp16's scaler starts lower by the
        smallest power of two from that maximum, so that the sum's scaled gradients are at most a mean's (and
        exact: a power of two), instead of overflowing in the first ~log2(tokens) steps, which it would skip."""
        if self.settled:
            return
        self.settled = True
        counted = self.scaler is not None and isinstance(weight, torch.Tensor)
        count = float(largest(weight.float())) if counted else 0.0
        if count >= 2:
            start = self.scaler.get_scale() / 2.0 ** math.ceil(math.log2(count))
            self.scaler = torch.amp.GradScaler(self.device_type, init_scale=start)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring scaled fp16 gradients back to true values before they are measured or clipped."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; returns False when the scaler skipped it for inf/nan gradients."""
        if not self.scaler:
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale

    def skip_step(self) -> None:
        """The step is skipped (non-finite loss or gradients): only the scaler learns from it."""
        if self.scaler:
            self.scaler.update()  # lowers the scale when the unscaled gradients held inf/nan

    def state_dict(self) -> dict[str, Any]:
        return {**self.scaler.state_dict(), "settled": self.settled} if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state:
            state = dict(state)
            # a checkpoint's scale goes on (one written before "settled" was kept: always after a backward);
            # a peer replica group's state sent before its first backward leaves the start to choose
            self.settled = bool(state.pop("settled", True))
            self.scaler.load_state_dict(state)
