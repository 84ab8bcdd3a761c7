"""Model FLOPs utilisation: the FLOPs a model's training needs per token, against a GPU's peak.

MFU (PaLM, Chowdhery et al. 2022, appendix B) = achieved model FLOP/s / peak FLOP/s. The model FLOPs are
what the math needs, not what the hardware did: activation recomputation is not counted, so MFU is
comparable across implementations. The peak is the dense BF16 tensor-core rate of the GPU, whatever the
run's precision, as PaLM, TorchTitan and Megatron report it.
"""

from __future__ import annotations

from typing import Any

import torch

# Dense (no 2:4 sparsity) BF16 tensor-core peak per GPU, in FLOP/s. NVIDIA's datasheets print the sparse
# rate for Hopper and Blackwell; the dense rate is half of it. Sources: A100 datasheet (312 TFLOPS BF16);
# H100 datasheet (SXM 1,979 / PCIe 1,513 / NVL 1,671 TFLOPS sparse); H200 datasheet (SXM 1,979 / NVL
# 1,671 sparse); DGX B200 (72 PFLOPS FP8 sparse for 8 GPUs = 4.5 PFLOPS BF16 sparse per GPU); GB200 NVL72
# (360 PFLOPS BF16 sparse for 72 GPUs). The same dense values are in TorchTitan's `get_peak_flops`.
# Matched in order as substrings of `torch.cuda.get_device_name`, so variants come before their family.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("A100", 312e12),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB": both variants have the same rate
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200 NVL", 835e12),
    ("H200", 989e12),  # "NVIDIA H200", also GH200
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
)


def peak_flops_by_name(device_name: str) -> float | None:
    """Dense BF16 peak FLOP/s of the GPU called `device_name` (as CUDA reports it); None if unknown."""
    for key, peak in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def peak_flops(device: torch.device | str) -> float | None:
    """Dense BF16 peak FLOP/s of `device`; None on the CPU and on GPUs missing from the table."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_by_name(torch.cuda.get_device_name(device))


def model_flops_per_token(module: Any, seq_len: int) -> float | None:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`, from the module's own
    `flops_per_token(seq_len)` hook; None when the module (or the model it wraps) does not declare one.

    The hook should follow PaLM: 6 x (non-embedding matmul parameters) + 12 x layers x heads x head_dim x
    seq_len. For a mixture of experts it must count the parameters a token activates (its top-k experts
    and the router), not all experts, or the MFU is overstated by the ratio of the two.
    """
    hook = getattr(module, "flops_per_token", None)
    if not callable(hook):
        return None
    try:
        flops = hook(seq_len)
    except AttributeError:  # a wrapper (CausalLM) whose inner model lacks the hook
        return None
    return float(flops)


def palm_flops_per_token(
    n_matmul_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> float:
    """PaLM's estimate of training FLOPs per token: 6 N for the matmuls (2 forward, 4 backward) plus
    12 L H d T for attention's two T x T products (QK^T and scores x V, forward and backward)."""
    return float(6 * n_matmul_params + 12 * n_layers * n_heads * head_dim * seq_len)


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilisation in [0, 1]: achieved model FLOP/s of one device over its peak."""
    if peak <= 0:
        raise ValueError(f"peak={peak!r} is invalid; allowed: a positive FLOP/s value")
    return tokens_per_s_per_device * flops_per_token / peak
