"""The MoE experts: routed SwiGLU experts as 3-D weights in one grouped matmul, and the shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes x (M, K) @ w (E, K, N): same float32/bfloat16/float16 dtype, at
    least one row, every non-unit stride a multiple of 16 bytes, and 16-byte aligned storage (on the CPU in
    torch 2.13 it raises otherwise; it also rejects float64 and int64 offsets)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype or x.dtype not in GROUPED_MM_DTYPES:
        return False
    if x.dim() != 2 or w.dim() != 3 or x.shape[0] == 0 or x.device.type not in ("cpu", "cuda"):
        return False
    for t in (x, w):
        if 1 not in t.stride() or t.data_ptr() % 16:
            return False
        if any(s != 1 and (s * t.element_size()) % 16 for s in t.stride()):
            return False
    return True


def _contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, use_grouped: bool = True
) -> torch.Tensor:
    """Rows of x in consecutive groups of `counts` rows, group e times w[e]: (M, K) @ (E, K, N) -> (M, N).

    One torch._grouped_mm where it applies (`grouped_mm_supported`), else a loop over the experts."""
    if use_grouped and grouped_mm_supported(x, w):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        y = torch._grouped_mm(x, w, offs=offsets)
        if y.requires_grad:  # its backward rejects an expanded (stride 0) gradient, e.g. of a .sum()
            y.register_hook(_contiguous_grad)
        return y
    return grouped_mm_loop(x, w, counts)


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The reference of `grouped_mm`: one matmul per expert (an expert with no rows contributes none)."""
    parts = [xe @ w[e] for e, xe in enumerate(torch.split(x, counts.tolist())) if xe.shape[0] > 0]
    if parts:
        return torch.cat(parts)
    # no rows (an expert-parallel rank that received none): an empty product that still gives every
    # weight (and x) a zero gradient, so every rank's FSDP reduces the same gradients
    return x @ w.sum(0)


class GroupedExperts(nn.Module):
    """E SwiGLU experts: w1, w3 (E, dim, ffn), w2 (E, ffn, dim); expert parallelism shards dim 0."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.use_grouped_mm = True

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, dim): rows sorted by expert, counts[e] of them for local expert e."""
        g = self.use_grouped_mm
        # expert parallelism shards the weights as DTensors on dim 0: compute with this rank's experts
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        device = x.device.type
        if torch.is_autocast_enabled(
            device
        ):  # torch._grouped_mm has no autocast rule: cast as a matmul would
            dtype = torch.get_autocast_dtype(device)
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        h = F.silu(grouped_mm(x, w1, counts, g)) * grouped_mm(x, w3, counts, g)
        return grouped_mm(h, w2, counts, g)


class SharedExperts(nn.Module):
    """n_shared SwiGLU experts applied to every token, as one SwiGLU of width n_shared * ffn (the same sum)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
