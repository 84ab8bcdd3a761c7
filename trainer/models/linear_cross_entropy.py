"""Cross-entropy of a linear head's logits computed over chunks of tokens: the B x T x V logits never exist.

As in Liger-Kernel's fused linear cross-entropy, each chunk's gradients are computed in the forward right
after its loss (no recompute), so at most one chunk's logits are alive; the backward only scales them.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
VOCAB_SLICE = 4096  # rows of the weight's gradient summed at a time


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """`F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100)` (the fp32 mean over the labelled
    tokens, NaN if there are none) for hidden [..., D], weight [V, D], labels [...], `chunk_tokens` at a
    time. Under autocast the matmuls run in its dtype and the softmax in fp32, as the plain `.float()`
    does."""
    device_type = hidden.device.type
    enabled = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if enabled else hidden.dtype
    hidden, labels = hidden.flatten(0, -2), labels.flatten()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens, dtype)
    loss_sum, count, _, _ = _chunked(hidden, weight, labels, chunk_tokens, dtype, (False, False))
    return loss_sum / count


class _LinearCrossEntropy(torch.autograd.Function):
    """The forward computes the loss and the gradients of its token sum; the backward scales them."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        wanted = ctx.needs_input_grad[:2]
        loss_sum, count, grad_hidden, grad_weight = _chunked(
            hidden, weight, labels, chunk_tokens, dtype, wanted
        )
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        return loss_sum / count

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor) -> tuple:
        # in place: the stored gradients serve one backward (a second one fails autograd's version check)
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_output / count.clamp(min=1)  # no labelled token: zero gradients, as F.cross_entropy's
        grad_hidden = grad_hidden.mul_(scale) if grad_hidden is not None else None
        grad_weight = grad_weight.mul_(scale) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    dtype: torch.dtype,
    wanted: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The fp32 loss summed over labelled tokens, their count, and (where `wanted`) the gradients of that sum
    w.r.t. hidden [N, D] (in its dtype) and weight (accumulated in fp32, returned in its dtype)."""
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes below are chosen explicitly
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if wanted[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wanted[1] else None
        )
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            grad_rows = grad_hidden[rows] if grad_hidden is not None else None
            loss_sum += _chunk(hidden[rows].to(dtype), labels[rows], w, grad_rows, grad_weight)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
    return loss_sum, (labels != IGNORE_INDEX).sum(), grad_hidden, grad_weight


def _chunk(
    h: torch.Tensor,
    target: torch.Tensor,
    w: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk's fp32 loss summed over its labelled tokens; writes the sum's gradient w.r.t. `h` into
    `grad_hidden` and adds the one w.r.t. `w` to `grad_weight` where given. Its [chunk, V] tensors, the
    only vocabulary-sized ones, are freed when it returns."""
    valid = target != IGNORE_INDEX
    target = target.masked_fill(~valid, 0)
    logits = (h @ w.t()).float()
    target_logit = logits.gather(1, target[:, None])
    peak = logits.amax(-1, keepdim=True)
    exp = logits.sub_(peak).exp_()  # in place, as every op below on it: one fp32 [chunk, V] buffer
    total = exp.sum(-1, keepdim=True)
    loss = ((peak + total.log() - target_logit) * valid[:, None]).sum()
    if grad_hidden is None and grad_weight is None:
        return loss
    # d(summed loss)/d(logits) = softmax - one_hot(target), zero for ignored tokens
    grad = exp.div_(total).mul_(valid[:, None])
    grad = grad.scatter_add_(1, target[:, None], -valid[:, None].float()).to(w.dtype)
    if grad_hidden is not None:
        grad_hidden.copy_(grad @ w)
    if grad_weight is not None:
        # by vocabulary slices: the product (in w's dtype) stays small, and so does the fp32 copy of it
        # that a mixed-dtype add makes on the CPU
        for rows in range(0, w.shape[0], VOCAB_SLICE):
            grad_weight[rows : rows + VOCAB_SLICE] += grad[:, rows : rows + VOCAB_SLICE].t() @ h
    return loss
