"""Per-sample gradient rules, one per layer type: from a layer's input A and output gradient G (both for the
whole batch) to each parameter's per-sample gradients, dense (B, *shape) or factored (`Outer`). Plus the
check that refuses modules whose per-sample gradients cannot be computed (or would be wrong)."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from strategies.privacy.per_sample_factored import Outer

Contribution = torch.Tensor | Outer  # a dense (B, *param.shape) tensor, or a factored one
Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor, Collection[str]], dict[str, Contribution]]


# ---- rules: (module, input as captured, output gradient in the compute dtype, trainable names) ----------
def _linear(
    m: nn.Module, x: torch.Tensor, g: torch.Tensor, names: Collection[str]
) -> dict[str, Contribution]:
    """y = x W^T + b on (B, ..., in): g_W = sum over positions of G^T A, g_b = sum of G."""
    B = x.shape[0]
    x, g = x.to(g.dtype).reshape(B, -1, x.shape[-1]), g.reshape(B, -1, g.shape[-1])
    out: dict[str, Contribution] = {}
    if "weight" in names:
        out["weight"] = Outer(g, x, g.shape[-1])
    if "bias" in names:
        out["bias"] = g.sum(1)
    return out


def _embedding(
    m: nn.Module, x: torch.Tensor, g: torch.Tensor, names: Collection[str]
) -> dict[str, Contribution]:
    """Row idx_t of the table gets G_t; the padding row gets nothing (as nn.Embedding's backward)."""
    B = x.shape[0]
    index, g = x.reshape(B, -1), g.reshape(B, -1, g.shape[-1])
    if m.padding_idx is not None:
        g = g.masked_fill((index == m.padding_idx)[..., None], 0.0)
    return {"weight": Outer(index, g, m.num_embeddings)}


def _per_feature(
    normed: torch.Tensor, g: torch.Tensor, names: Collection[str], ndim: int
) -> dict[str, Contribution]:
    """A norm's affine part y = normed * w + b, w and b over the last `ndim` dims: sums over positions."""
    B, features = g.shape[0], g.shape[g.dim() - ndim :]
    out: dict[str, Contribution] = {}
    if "weight" in names:
        out["weight"] = (g * normed).reshape(B, -1, *features).sum(1)
    if "bias" in names:
        out["bias"] = g.reshape(B, -1, *features).sum(1)
    return out


def _layer_norm(
    m: nn.Module, x: torch.Tensor, g: torch.Tensor, names: Collection[str]
) -> dict[str, Contribution]:
    normed = F.layer_norm(x.to(g.dtype), m.normalized_shape, eps=m.eps)
    return _per_feature(normed, g, names, len(m.normalized_shape))


def _group_norm(
    m: nn.Module, x: torch.Tensor, g: torch.Tensor, names: Collection[str]
) -> dict[str, Contribution]:
    """Input (B, C, *): the channel dim moved last so the parameters cover the last dim."""
    normed = F.group_norm(x.to(g.dtype), m.num_groups, eps=m.eps)
    return _per_feature(normed.movedim(1, -1), g.movedim(1, -1), names, 1)


def _rms_norm(
    m: nn.Module, x: torch.Tensor, g: torch.Tensor, names: Collection[str]
) -> dict[str, Contribution]:
    """torch.nn.RMSNorm; eps=None means the epsilon of the input's own dtype, as its forward."""
    eps = torch.finfo(x.dtype).eps if m.eps is None else m.eps
    normed = F.rms_norm(x.to(g.dtype), m.normalized_shape, eps=eps)
    return _per_feature(normed, g, names, len(m.normalized_shape))


def llama_normed(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """trainer.models.llama.RMSNorm's normalisation, float32 then cast back, exactly as its forward."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + m.eps)).type_as(x)


def llama_rms_norm(
    m: nn.Module, x: torch.Tensor, g: torch.Tensor, names: Collection[str]
) -> dict[str, Contribution]:
    """A module class named RMSNorm computing weight * normed(x) (checked on its first call)."""
    return _per_feature(llama_normed(m, x).to(g.dtype), g, names, 1)


def _conv_pads(m: nn.Module) -> list[int]:
    """F.pad's list (last dim first) for the conv's padding: ints, "valid" or "same"."""
    pads: list[int] = []
    for i in reversed(range(len(m.kernel_size))):
        if m.padding == "same":
            total = m.dilation[i] * (m.kernel_size[i] - 1)
            pads += [total // 2, total - total // 2]
        elif m.padding == "valid":
            pads += [0, 0]
        else:
            pads += [m.padding[i]] * 2
    return pads


def _conv(m: nn.Module, x: torch.Tensor, g: torch.Tensor, names: Collection[str]) -> dict[str, Contribution]:
    """Conv1d/Conv2d as a Linear over unfolded patches (a Conv1d is a Conv2d of height 1); with groups, one
    patch block per group."""
    B, groups = x.shape[0], m.groups
    mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
    x = F.pad(x.to(g.dtype), _conv_pads(m), mode=mode)
    kernel, stride, dilation = m.kernel_size, m.stride, m.dilation
    if isinstance(m, nn.Conv1d):
        x, g = x.unsqueeze(2), g.unsqueeze(2)
        kernel, stride, dilation = (1, *kernel), (1, *stride), (1, *dilation)
    patches = F.unfold(x, kernel, dilation=dilation, stride=stride)  # (B, C * prod(kernel), L)
    g = g.reshape(B, m.out_channels, -1)  # (B, out, L)
    out: dict[str, Contribution] = {}
    if "weight" in names and groups == 1:
        out["weight"] = Outer(g.mT, patches.mT, m.out_channels)
    elif "weight" in names:
        per_group = torch.einsum(
            "bgol,bgcl->bgoc",
            g.view(B, groups, -1, g.shape[-1]),
            patches.view(B, groups, -1, patches.shape[-1]),
        )
        out["weight"] = per_group.reshape(B, *m.weight.shape)
    if "bias" in names:
        out["bias"] = g.sum(2)
    return out


# a rule applies to a subclass only if it keeps the class's forward
_RULES: tuple[tuple[type[nn.Module], Rule], ...] = (
    (nn.Linear, _linear),
    (nn.Embedding, _embedding),
    (nn.LayerNorm, _layer_norm),
    (nn.GroupNorm, _group_norm),
    (nn.RMSNorm, _rms_norm),
    (nn.Conv1d, _conv),
    (nn.Conv2d, _conv),
)


def rule_for(module: nn.Module) -> Rule | None:
    """The per-sample gradient rule of this module, or None for the torch.func fallback."""
    for cls, rule in _RULES:
        if isinstance(module, cls) and type(module).forward is cls.forward:
            return rule
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if (
        type(module).__name__ == "RMSNorm"
        and own == ["weight"]
        and isinstance(getattr(module, "eps", None), float)
    ):
        return llama_rms_norm if module.weight.dim() == 1 else None
    return None


def check_supported(name: str, module: nn.Module, trainable: bool) -> None:
    """A ValueError naming a module whose per-sample gradients cannot be computed (or would be wrong)."""
    kind = type(module).__name__
    if isinstance(module, _BatchNorm):
        raise ValueError(
            f"per-sample gradients cannot handle BatchNorm: '{name}' ({kind}) normalises with statistics of "
            "the whole batch, so each sample's gradient depends on the others; allowed: GroupNorm, LayerNorm "
            "or RMSNorm (they normalise each sample alone), e.g. nn.GroupNorm(num_groups, num_channels)"
        )
    if not trainable:
        return
    reason = None
    if isinstance(module, nn.RNNBase):
        reason = "torch.func cannot batch recurrent layers per sample; build the recurrence from nn.Linear"
    elif isinstance(module, nn.MultiheadAttention):
        reason = (
            "its forward reads out_proj's weights without calling out_proj; build attention from nn.Linear"
        )
    elif isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
        reason = "scale_grad_by_freq scales gradients by counts over the whole batch; set it to False"
    elif isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        reason = "its parameters are not materialised yet; run one forward before"
    if reason:
        raise ValueError(f"per-sample gradients cannot handle '{name}' ({kind}): {reason}")
