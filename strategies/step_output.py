"""StepOutput, a step's loss and token count: read from what a *_step returns, combined over micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.core.dtensors import is_dtensor


@dataclass
class StepOutput:
    """What one micro-batch's forward+backward produced: the (unscaled, detached) loss and its token count."""

    loss: torch.Tensor
    num_tokens: torch.Tensor | None = None


def unpack_loss(output: Any, method: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss (and optional "num_tokens") from what a *_step returned; a clear error if there is none."""
    num_tokens = None
    if isinstance(output, dict):
        num_tokens = output.get("num_tokens")
        output = output.get("loss")
    if type(output) is not torch.Tensor and is_dtensor(output):  # a DTensor loss (tensor parallel): its value
        output = output.full_tensor()
    if not isinstance(output, torch.Tensor) or output.numel() != 1:
        raise TypeError(
            f"{method} returned {type(output).__name__}; allowed: a scalar loss tensor or a dict with a 'loss' scalar tensor"
        )
    if num_tokens is not None:
        num_tokens = torch.as_tensor(num_tokens, dtype=torch.float32, device=output.device)
    return (output.reshape(()) if output.dim() else output), num_tokens


def combine_micro_batches(outputs: list[StepOutput]) -> StepOutput:
    """One step's loss over its micro-batches: token-weighted when they report num_tokens, else their mean."""
    counts = [o.num_tokens for o in outputs]
    if len(outputs) == 1:
        return outputs[0]
    if all(c is None for c in counts):
        return StepOutput(torch.stack([o.loss for o in outputs]).float().mean())
    if any(c is None for c in counts):
        raise ValueError(
            "training_step returned 'num_tokens' for some micro-batches but not others; return it always or never"
        )
    n = torch.stack(counts)
    return StepOutput((torch.stack([o.loss.float() for o in outputs]) * n).sum() / n.sum(), n.sum())
