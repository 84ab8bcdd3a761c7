"""Per-sample gradients for DP-SGD, computed from the ordinary forward/backward of `training_step`.

While `PerSampleGradients.capture()` is active, a forward hook on every module that directly owns trainable
parameters stores the module's input (detached) and puts a tensor hook on its output that stores the
output's gradient. After `loss.backward()`, a rule per layer type turns activation A and output gradient G
into per-sample gradients (Linear, Embedding, LayerNorm, GroupNorm, RMSNorm, Conv1d/Conv2d); any other
module owning parameters gets them from torch.func (`vmap` over samples of the module's vjp), as Opacus's
hooks mode does. The user's `training_step` stays plain Python (`self(x)`, `self.log`, `.item()`).

Ghost clipping (mode "ghost") never materialises per-sample gradients of Linear/Embedding/Conv weights:
their norms come from A and G (Li et al. 2022, "Large language models can be strong differentially private
learners"), and the clipped sum is one weighted matmul over the stored A and G (Bu et al. 2023's
book-keeping: no second backward).

Assumptions: dim 0 of every layer's input is the batch (checked: all layers must agree); a parameter gets
its gradient only through the forward of a module that owns it (checked where a parameter got a gradient
but no module call saw it); no module mixes samples (BatchNorm is refused).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

LOSS_REDUCTIONS = ("mean", "sum")
MODES = ("hooks", "ghost")
CLIPPINGS = ("flat", "per_layer")
ROOT = "(root)"  # how errors and per-layer norms name the module passed in


@dataclass
class Outer:
    """A per-sample gradient in factored form: g_b = left_b^T @ right_b, a sum over T rows. `left` is
    (B, T, rows), or (B, T) indices into `rows` (an embedding's one-hot rows, never built); `right` is
    (B, T, n)."""

    left: torch.Tensor
    right: torch.Tensor
    rows: int

    def materialise(self) -> torch.Tensor:
        """The per-sample gradients, (B, rows, n)."""
        if self.left.is_floating_point():
            return torch.bmm(self.left.mT, self.right)
        B, _, n = self.right.shape
        offsets = torch.arange(B, device=self.left.device)[:, None] * self.rows
        flat = self.right.new_zeros(B * self.rows, n)
        flat.index_add_(0, (self.left + offsets).reshape(-1), self.right.reshape(-1, n))
        return flat.view(B, self.rows, n)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """sum_b weights_b * g_b, (rows, n), without the per-sample gradients."""
        n = self.right.shape[-1]
        right = (self.right * weights[:, None, None]).reshape(-1, n)
        if self.left.is_floating_point():
            return self.left.reshape(-1, self.rows).T @ right
        return right.new_zeros(self.rows, n).index_add_(0, self.left.reshape(-1), right)


Contribution = torch.Tensor | Outer  # a dense (B, *param.shape) tensor, or a factored one
Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor, Collection[str]], dict[str, Contribution]]


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


def _ghost_sq_norms(parts: list[Outer]) -> torch.Tensor:
    """||sum_c left_c^T right_c||^2 per sample = sum_{c,d} <left_c left_d^T, right_c right_d^T> (the
    ghost norm; the cross terms cover a weight used by several calls or shared by tied layers)."""
    terms = []
    for i, a in enumerate(parts):
        for j in range(i, len(parts)):
            term = (_left_gram(a, parts[j]) * torch.bmm(a.right, parts[j].right.mT)).sum((1, 2))
            terms.append(term if i == j else 2 * term)
    return torch.stack(terms).sum(0)


def _ghost_is_cheaper(parts: list[Outer]) -> bool:
    """Li et al.'s choice per layer: Gram matrices (B, T, T) beat per-sample gradients (B, rows, n) when
    2 T^2 < rows * n (T: all rows of all calls)."""
    T = sum(part.right.shape[1] for part in parts)
    return 2 * T * T < parts[0].rows * parts[0].right.shape[-1]


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


def _llama_normed(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """trainer.models.llama.RMSNorm's normalisation, float32 then cast back, exactly as its forward."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + m.eps)).type_as(x)


def _llama_rms_norm(
    m: nn.Module, x: torch.Tensor, g: torch.Tensor, names: Collection[str]
) -> dict[str, Contribution]:
    """A module class named RMSNorm computing weight * normed(x) (checked on its first call)."""
    return _per_feature(_llama_normed(m, x).to(g.dtype), g, names, 1)


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


def _rule_for(module: nn.Module) -> Rule | None:
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
        return _llama_rms_norm if module.weight.dim() == 1 else None
    return None


def _check_supported(name: str, module: nn.Module, trainable: bool) -> None:
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


def _compute_dtype(params: Collection[nn.Parameter]) -> torch.dtype:
    """float32, or wider if a parameter is: per-sample work in bf16/fp16 would blur the clipping."""
    return functools.reduce(torch.promote_types, (p.dtype for p in params), torch.float32)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """A layer's input: its first tensor argument (a rule's x; dim 0 is the batch)."""
    return next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))


@dataclass
class _Call:
    """One forward of a layer: its inputs (detached), its differentiable outputs' positions among the output's
    leaves with their shapes/dtypes, and their gradients (filled by backward; None if none arrived)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out_index: list[int]
    out_meta: list[tuple[torch.Size, torch.dtype]]
    grads: list[torch.Tensor | None]


@dataclass
class _Layer:
    """A module that directly owns trainable parameters, its rule (None: torch.func) and its calls."""

    name: str
    module: nn.Module
    params: dict[str, nn.Parameter]
    rule: Rule | None
    verify: bool  # a rule matched by class name: compared with the module's output on its first call
    calls: list[_Call] = field(default_factory=list)


class ClippedSum(NamedTuple):
    """What `clip_and_accumulate` gives: sum_i c_i g_i per parameter, the norms ||g_i|| before clipping."""

    grads: dict[nn.Parameter, torch.Tensor]
    norms: torch.Tensor


def _store_grad(call: _Call, slot: int, grad: torch.Tensor) -> None:
    previous = call.grads[slot]
    call.grads[slot] = grad.detach() if previous is None else previous + grad.detach()


class PerSampleGradients:
    """Per-sample gradients of `module`'s trainable parameters, their norms, and their clipped sum.

    `loss_reduction`: how the back-propagated loss combines the B samples' losses: "mean" (the captured
    output gradients carry 1/B, so every rule's result is multiplied by B) or "sum". The per-sample gradient
    is always that of one sample's own loss. `mode`: "hooks" materialises every per-sample gradient (B copies
    of the parameters); "ghost" computes Linear/Embedding/Conv weight norms from activations and output
    gradients and their clipped sum by one matmul, other parameters as in "hooks". `clipping`: "flat" (one
    norm over all parameters) or "per_layer" (a norm per module owning parameters; see `clip_and_accumulate`).
    """

    def __init__(
        self, module: nn.Module, loss_reduction: str = "mean", mode: str = "hooks", clipping: str = "flat"
    ) -> None:
        for value, allowed, what in (
            (loss_reduction, LOSS_REDUCTIONS, "loss_reduction"),
            (mode, MODES, "mode"),
            (clipping, CLIPPINGS, "clipping"),
        ):
            if value not in allowed:
                raise ValueError(f"{what}={value!r} is unknown; allowed: {', '.join(allowed)}")
        self.module, self.loss_reduction, self.mode, self.clipping = module, loss_reduction, mode, clipping
        self.params: list[nn.Parameter] = list(
            dict.fromkeys(p for p in module.parameters() if p.requires_grad)
        )
        self._names = {p: n for n, p in reversed(list(module.named_parameters()))}  # a tied one: first name
        self._layers: list[_Layer] = []
        self._group_of: dict[nn.Parameter, str] = {}  # per-layer clipping: the first module owning it
        for path, sub in module.named_modules():
            name = path or ROOT
            own = {n: p for n, p in sub.named_parameters(recurse=False) if p.requires_grad}
            _check_supported(name, sub, bool(own))
            if own:
                rule = _rule_for(sub)
                self._layers.append(_Layer(name, sub, own, rule, verify=rule is _llama_rms_norm))
                for p in own.values():
                    self._group_of.setdefault(p, name)
        self.layer_names: list[str] = list(dict.fromkeys(self._group_of.values()))
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._recording = False
        self.clear()

    # ---- capture ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the tracked layers' inputs and output gradients of the forward and backward run inside.
        The hooks exist only inside (evaluation outside is untouched); an exception inside clears the data."""
        if self._handles:
            raise RuntimeError("capture() is already active")
        if any(layer.calls for layer in self._layers):
            raise RuntimeError("the previous capture was not consumed; call clip_and_accumulate() or clear()")
        self._handles = [
            layer.module.register_forward_hook(functools.partial(self._record, layer), with_kwargs=True)
            for layer in self._layers
        ]
        self._recording = True
        try:
            yield
        except BaseException:
            self.clear()
            raise
        finally:
            self._recording = False
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def _record(
        self, layer: _Layer, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        """Forward hook: keep the inputs, hook the differentiable outputs (skips a call under no_grad)."""
        if not self._recording:
            return
        leaves = tree_flatten(output)[0]
        index = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not index:
            return
        if layer.verify:
            self._verify(layer, _first_tensor(args, kwargs), output)
        detach = functools.partial(tree_map_only, torch.Tensor, torch.Tensor.detach)
        call = _Call(
            detach(args),
            detach(kwargs),
            index,
            [(leaves[i].shape, leaves[i].dtype) for i in index],
            [None] * len(index),
        )
        for slot, i in enumerate(index):
            leaves[i].register_hook(functools.partial(_store_grad, call, slot))
        layer.calls.append(call)

    @staticmethod
    def _verify(layer: _Layer, x: torch.Tensor, output: Any) -> None:
        """A module matched by class name only (RMSNorm) keeps its rule if its output is weight * normed(x);
        otherwise it gets the torch.func fallback, which is exact for any formula."""
        layer.verify = False
        with torch.no_grad():
            expected = layer.module.weight * _llama_normed(layer.module, x)
        matches = isinstance(output, torch.Tensor) and expected.shape == output.shape
        if not (matches and torch.allclose(expected, output, rtol=1e-3, atol=1e-5)):
            layer.rule = None

    # ---- per-sample gradients ------------------------------------------------------------------------------
    def _contributions(self) -> dict[nn.Parameter, list[Contribution]]:
        """Every parameter's per-sample gradient terms, one per layer call (scaled by B for a mean loss)."""
        if self._parts is not None:
            return self._parts
        calls = [
            (layer, c) for layer in self._layers for c in layer.calls if any(g is not None for g in c.grads)
        ]
        if not calls:
            raise RuntimeError("nothing was captured: run the forward and loss.backward() inside capture()")
        sizes = {(layer.name, _first_tensor(c.args, c.kwargs).shape[0]) for layer, c in calls}
        if len({b for _, b in sizes}) > 1:
            seen = ", ".join(f"'{n}': {b}" for n, b in sorted(sizes))
            raise ValueError(
                f"layers saw different batch sizes in dim 0 of their inputs ({seen}); per-sample gradients "
                "read the batch from dim 0 of every layer's input: keep it there (no reshape of (B, T, D) to "
                "(B * T, D) before a layer)"
            )
        B = next(iter(sizes))[1]
        scale = float(B) if self.loss_reduction == "mean" else 1.0
        parts: dict[nn.Parameter, list[Contribution]] = {p: [] for p in self.params}
        for layer, call in calls:
            x = _first_tensor(call.args, call.kwargs)
            grads = [
                torch.zeros(shape, dtype=out_dtype, device=x.device) if g is None else g * scale
                for g, (shape, out_dtype) in zip(call.grads, call.out_meta, strict=True)
            ]
            dtype = _compute_dtype(layer.params.values())
            if layer.rule is not None:
                terms = layer.rule(layer.module, x, grads[0].to(dtype), layer.params.keys())
            else:
                terms = self._vmap_rule(layer, call, grads, B)
            for name, term in terms.items():
                parts[layer.params[name]].append(term if isinstance(term, Outer) else term.to(dtype))
        missing = [
            self._names[p] for p in self.params if not parts[p] and p.grad is not None and bool(p.grad.any())
        ]
        if missing:
            raise RuntimeError(
                f"parameters {missing} got gradients outside the forward of the modules that own them (used "
                "directly in training_step, or read as `module.weight` by another module); per-sample "
                "gradients see only what flows through an owning module's forward: use them there"
            )
        self.batch_size, self._parts = B, parts
        return parts

    def _vmap_rule(
        self, layer: _Layer, call: _Call, grads: list[torch.Tensor], B: int
    ) -> dict[str, Contribution]:
        """torch.func for a module without a rule: vmap over samples of the vjp of the module's own
        parameters, re-running its forward on one sample (as a batch of 1) with the stored inputs."""
        leaves, spec = tree_flatten((call.args, call.kwargs))
        batched = [
            i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == B
        ]
        module, out_index = layer.module, call.out_index

        def one_sample(
            params: dict[str, torch.Tensor], inputs: list[torch.Tensor], cotangents: list[torch.Tensor]
        ) -> dict[str, torch.Tensor]:
            full = list(leaves)
            for i, t in zip(batched, inputs, strict=True):
                full[i] = t.unsqueeze(0)
            args, kwargs = tree_unflatten(full, spec)

            def outputs(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
                flat = tree_flatten(functional_call(module, p, args, kwargs))[0]
                return tuple(flat[i] for i in out_index)

            _, pullback = vjp(outputs, params)
            return pullback(tuple(g.unsqueeze(0) for g in cotangents))[0]

        params = {n: p.detach() for n, p in layer.params.items()}
        recording, self._recording = self._recording, False  # its re-run of submodules is no new call
        try:
            with torch.no_grad():  # no graph back to the submodules' parameters (torch.func ignores this)
                return vmap(one_sample, in_dims=(None, 0, 0))(params, [leaves[i] for i in batched], grads)
        except Exception as error:
            raise RuntimeError(
                f"per-sample gradients cannot handle '{layer.name}' ({type(module).__name__}): it has no "
                f"rule and torch.func could not vmap its forward over samples ({type(error).__name__}: "
                f"{error}); make its forward per-sample (no data-dependent Python control flow, no .item(), "
                "no dropout) or build it from nn.Linear/nn.Embedding/norm/conv layers"
            ) from error
        finally:
            self._recording = recording

    def per_sample_grads(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each trainable parameter's per-sample gradients (B, *shape): the gradient of each sample's own
        loss, in float32 (float64 for a float64 parameter). Materialises them, also in ghost mode."""
        return {p: self._materialised(p) for p in self.params}

    def _materialised(self, p: nn.Parameter) -> torch.Tensor:
        if p not in self._dense:
            parts = self._contributions()[p]
            total = torch.zeros(self.batch_size, *p.shape, dtype=_compute_dtype([p]), device=p.device)
            for part in parts:
                total += (part.materialise() if isinstance(part, Outer) else part).reshape(total.shape)
            self._dense[p] = total
        return self._dense[p]

    def _sq_norms(self, p: nn.Parameter) -> torch.Tensor:
        """||g_i||^2 of one parameter, (B,): from the Gram matrices in ghost mode where that is cheaper."""
        parts = self._contributions()[p]
        if not parts:
            return torch.zeros(self.batch_size, dtype=_compute_dtype([p]), device=p.device)
        outers = [part for part in parts if isinstance(part, Outer)]
        if self.mode == "ghost" and len(outers) == len(parts) and _ghost_is_cheaper(outers):
            return _ghost_sq_norms(outers)
        return self._materialised(p).flatten(1).pow(2).sum(1)

    def per_layer_norms(self) -> dict[str, torch.Tensor]:
        """Per-sample gradient norms (B,) of each layer, keyed by module path: a layer is the parameters a
        module owns itself (a tied parameter counts with the first owner). The units of per-layer clipping."""
        if self._layer_norms is None:
            squares: dict[str, Any] = dict.fromkeys(self.layer_names, 0.0)
            for p in self.params:
                squares[self._group_of[p]] = squares[self._group_of[p]] + self._sq_norms(p)
            self._layer_norms = {name: sq.sqrt() for name, sq in squares.items()}
        return self._layer_norms

    def per_sample_norms(self) -> torch.Tensor:
        """||g_i|| over all trainable parameters jointly, (B,)."""
        return sum(n.pow(2) for n in self.per_layer_norms().values()).sqrt()

    # ---- clipping ---------------------------------------------------------------------------------------
    def clip_and_accumulate(self, max_grad_norm: float) -> ClippedSum:
        """Clip each sample's gradient and sum over the batch. Flat: sample i is scaled by
        c_i = min(1, C / (||g_i|| + 1e-6)), its norm over all parameters. Per layer: each layer's part by
        min(1, C_l / (||g_i,l|| + 1e-6)) with C_l = C / sqrt(num_layers), so the joint norm stays <= C.

        Returns the sums (parameter -> tensor shaped like it, float32 or float64; zeros for a parameter that
        got no gradient) and the per-sample norms before clipping. Then sets every tracked parameter's .grad
        to None (the plain batch gradient is not private) and clears the captured data."""
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm} is not positive; allowed: > 0")
        layer_norms, norms = self.per_layer_norms(), self.per_sample_norms()
        if self.clipping == "flat":
            flat = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            factors = dict.fromkeys(self.layer_names, flat)
        else:
            budget = max_grad_norm / math.sqrt(len(self.layer_names))
            factors = {name: (budget / (n + 1e-6)).clamp(max=1.0) for name, n in layer_norms.items()}
        sums = {p: self._clipped_sum(p, factors[self._group_of[p]]) for p in self.params}
        for p in self.params:
            p.grad = None
        self.clear()
        return ClippedSum(sums, norms)

    def _clipped_sum(self, p: nn.Parameter, factors: torch.Tensor) -> torch.Tensor:
        """sum_i factors_i g_i: from the materialised gradients if there are any, else from A and G."""
        dtype = _compute_dtype([p])
        factors = factors.to(dtype)
        if p in self._dense:
            return torch.tensordot(factors, self._dense[p], dims=1)
        total = torch.zeros(p.shape, dtype=dtype, device=p.device)
        for part in self._contributions()[p]:
            term = (
                part.weighted_sum(factors)
                if isinstance(part, Outer)
                else torch.tensordot(factors, part, dims=1)
            )
            total += term.reshape(p.shape)
        return total

    def clear(self) -> None:
        """Drop every captured activation, gradient and result (also the error path of a step)."""
        for layer in self._layers:
            layer.calls.clear()
        self._parts: dict[nn.Parameter, list[Contribution]] | None = None
        self._dense: dict[nn.Parameter, torch.Tensor] = {}
        self._layer_norms: dict[str, torch.Tensor] | None = None
        self.batch_size: int | None = None
