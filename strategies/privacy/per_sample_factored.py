"""Per-sample gradients of Linear/Embedding/Conv weights kept in factored form, g_b = left_b^T @ right_b,
and the two exact ways to get their norms: Gram matrices of the factors (ghost norms, Li et al. 2022) or
instantiating the gradients a few samples at a time (never all B at once). The clipped sum is one matmul
of the factors with the clip factors folded into one side (Bu et al. 2023's book-keeping), in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# a chunk of instantiated per-sample gradients holds about this many elements (16 MiB in float32): small
# enough to stay in cache between the matmul writing it and the norm reading it
_CHUNK_ELEMENTS = 1 << 22


@dataclass
class Outer:
    """A per-sample gradient in factored form: g_b = left_b^T @ right_b, a sum over T rows. `left` is
    (B, T, rows), or (B, T) indices into `rows` (an embedding's one-hot rows, never built); `right` is
    (B, T, n)."""

    left: torch.Tensor
    right: torch.Tensor
    rows: int

    @property
    def cols(self) -> int:
        """n: the weight's second dimension (its input features)."""
        return self.right.shape[-1]

    def add_into(self, out: torch.Tensor, start: int, stop: int) -> None:
        """out += the per-sample gradients of samples [start, stop), out shaped (stop - start, rows, n)."""
        right = self.right[start:stop]
        if self.left.is_floating_point():
            out.baddbmm_(self.left[start:stop].mT, right)
            return
        offsets = torch.arange(stop - start, device=out.device)[:, None] * self.rows
        index = (self.left[start:stop] + offsets).reshape(-1)
        out.view(-1, self.cols).index_add_(0, index, right.reshape(-1, self.cols))

    def materialise(self) -> torch.Tensor:
        """The per-sample gradients, (B, rows, n)."""
        if self.left.is_floating_point():
            return torch.bmm(self.left.mT, self.right)
        out = self.right.new_zeros(self.right.shape[0], self.rows, self.cols)
        self.add_into(out, 0, out.shape[0])
        return out

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """sum_b weights_b * g_b, (rows, n), without the per-sample gradients: the weights go on the
        narrower factor, then one matmul (an index_add for an embedding) over all B x T rows."""
        n = self.cols
        if not self.left.is_floating_point():
            right = (self.right * weights[:, None, None]).reshape(-1, n)
            return right.new_zeros(self.rows, n).index_add_(0, self.left.reshape(-1), right)
        left, right = self.left, self.right
        if self.rows <= n:
            left = left * weights[:, None, None]
        else:
            right = right * weights[:, None, None]
        return left.reshape(-1, self.rows).T @ right.reshape(-1, n)


def _left_gram(a: Outer, b: Outer) -> torch.Tensor:
    """left_a @ left_b^T per sample, (B, Ta, Tb); an index side is read as its one-hot rows."""
    dense_a, dense_b = a.left.is_floating_point(), b.left.is_floating_point()
    if dense_a and dense_b:
        return torch.bmm(a.left, b.left.mT)
    if not dense_a and not dense_b:
        return (a.left[:, :, None] == b.left[:, None, :]).to(a.right.dtype)
    if dense_a:
        return torch.gather(a.left, 2, b.left[:, None, :].expand(-1, a.left.shape[1], -1))
    return torch.gather(b.left, 2, a.left[:, None, :].expand(-1, b.left.shape[1], -1)).mT


def ghost_sq_norms(parts: list[Outer]) -> torch.Tensor:
    """||sum_c left_c^T right_c||^2 per sample = sum_{c,d} <left_c left_d^T, right_c right_d^T> (the
    ghost norm; the cross terms cover a weight used by several calls or shared by tied layers)."""
    total = None
    for i, a in enumerate(parts):
        for j in range(i, len(parts)):
            gram = _left_gram(a, parts[j]).mul_(torch.bmm(a.right, parts[j].right.mT))
            term = gram.sum((1, 2)) if i == j else 2 * gram.sum((1, 2))
            total = term if total is None else total + term
    return total


def instantiated_sq_norms(parts: list[Outer]) -> torch.Tensor:
    """||g_b||^2 per sample from the per-sample gradients themselves, built a chunk of samples at a time
    into one reused buffer (peak memory: one chunk, not B copies of the weight)."""
    first = parts[0]
    B, rows, n = first.right.shape[0], first.rows, first.cols
    chunk = max(1, min(B, _CHUNK_ELEMENTS // (rows * n)))
    buffer = first.right.new_empty(chunk, rows, n)
    out = first.right.new_empty(B)
    single_dense = len(parts) == 1 and first.left.is_floating_point()
    for start in range(0, B, chunk):
        stop = min(B, start + chunk)
        grads = buffer[: stop - start]
        if single_dense:  # written, not added: no zeroing pass
            torch.bmm(first.left[start:stop].mT, first.right[start:stop], out=grads)
        else:
            grads.zero_()
            for part in parts:
                part.add_into(grads, start, stop)
        torch.linalg.vector_norm(grads.view(stop - start, -1), dim=1, out=out[start:stop])
    return out.square_()


def ghost_is_cheaper(parts: list[Outer]) -> bool:
    """Bu et al.'s per-layer choice: Gram matrices (B, T, T) beat per-sample gradients (B, rows, n) when
    2 T^2 < rows * n (T: all rows of all calls of the weight)."""
    T = sum(part.right.shape[1] for part in parts)
    return 2 * T * T < parts[0].rows * parts[0].cols
