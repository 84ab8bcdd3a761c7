"""Per-sample gradients for DP-SGD, computed from the ordinary forward/backward of `training_step`.

While `PerSampleGradients.capture()` is active, a forward hook on every module that directly owns trainable
parameters stores the module's input (detached) and puts a tensor hook on its output. As the output's
gradient arrives, a rule per layer type (strategies/privacy/per_sample_rules.py) turns activation A and output
gradient G into per-sample gradients (Linear, Embedding, LayerNorm, GroupNorm, RMSNorm, Conv1d/Conv2d).
Under `backward()` a norm's (B x features) replace its A and G at once: the rest of the backward need not
hold them. Any other module owning parameters gets them after the backward from torch.func (`vmap` over
samples of the module's vjp), as Opacus's hooks mode does. The user's `training_step` stays plain Python.

Linear/Embedding/Conv weights stay factored (strategies/privacy/per_sample_factored.py): their per-sample norms come
from Gram matrices of A and G (ghost norms) or from the per-sample gradients built a chunk of samples at a
time, and their clipped sum is one matmul of A and the clip-weighted G (no second backward, and no B copies
of a weight). `backward(loss)` computes only what this needs: gradients of the layers' outputs, not the
parameters' batch gradient, which DP-SGD discards.

Assumptions: dim 0 of every layer's input is the batch (checked: all layers must agree); a parameter gets
its gradient only through the forward of a module that owns it (checked where a parameter got a gradient
but no module call saw it); no module mixes samples (BatchNorm is refused).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from strategies.privacy.per_sample_factored import (
    Outer,
    ghost_is_cheaper,
    ghost_sq_norms,
    instantiated_sq_norms,
)
from strategies.privacy.per_sample_rules import (
    Contribution,
    Rule,
    check_supported,
    llama_normed,
    llama_rms_norm,
    rule_for,
)

LOSS_REDUCTIONS = ("mean", "sum")
# how a factored weight's per-sample norms are computed: per layer the cheaper exact way (Bu et al.'s mixed
# ghost clipping), always by instantiating the per-sample gradients, or always by Gram matrices
MODES = ("mixed", "hooks", "ghost")
CLIPPINGS = ("flat", "per_layer")
ROOT = "(root)"  # how errors and per-layer norms name the module passed in


def _compute_dtype(params: Collection[nn.Parameter]) -> torch.dtype:
    """float32, or wider if a parameter is: per-sample work in bf16/fp16 would blur the clipping."""
    return functools.reduce(torch.promote_types, (p.dtype for p in params), torch.float32)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """A layer's input: its first tensor argument (a rule's x; dim 0 is the batch)."""
    return next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))


@dataclass
class _Call:
    """One forward of a layer: its inputs (detached), its differentiable outputs' positions among the output's
    leaves with their shapes/dtypes, their gradients (filled by backward; None if none arrived) and its batch
    size. A layer with a rule gets its `terms` instead, one set per backward as its output's gradient
    arrives."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out_index: list[int]
    out_meta: list[tuple[torch.Size, torch.dtype]]
    grads: list[torch.Tensor | None]
    batch: int
    terms: list[dict[str, Contribution]] = field(default_factory=list)


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
    is always that of one sample's own loss. `mode` says how a Linear/Embedding/Conv weight's per-sample norms
    are computed, all exactly: "mixed" per weight the cheaper way (Gram matrices where 2 T^2 < rows x cols, T
    its input rows per sample, else the per-sample gradients a chunk of samples at a time), "hooks" always
    from the per-sample gradients, "ghost" always from Gram matrices. Its clipped sum is one matmul in every
    mode; other parameters' per-sample gradients are built whole (they are small). `clipping`: "flat" (one
    norm over all parameters) or "per_layer" (a norm per module owning parameters; see `clip_and_accumulate`).
    """

    def __init__(
        self, module: nn.Module, loss_reduction: str = "mean", mode: str = "mixed", clipping: str = "flat"
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
            check_supported(name, sub, bool(own))
            if own:
                rule = rule_for(sub)
                self._layers.append(_Layer(name, sub, own, rule, verify=rule is llama_rms_norm))
                for p in own.values():
                    self._group_of.setdefault(p, name)
        self.layer_names: list[str] = list(dict.fromkeys(self._group_of.values()))
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._recording = False
        self._last_backward = False  # inside `backward()`: no later backward can reach a captured output
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
            _first_tensor(args, kwargs).shape[0],
        )
        for slot, i in enumerate(index):
            if layer.rule is not None and len(index) == 1:
                leaves[i].register_hook(functools.partial(self._apply_rule, layer, call))
            else:
                leaves[i].register_hook(functools.partial(_store_grad, call, slot))
            self._edges.append(get_gradient_edge(leaves[i]))
        layer.calls.append(call)

    def _apply_rule(self, layer: _Layer, call: _Call, grad: torch.Tensor) -> None:
        """Tensor hook of a layer with a rule: its per-sample terms as soon as its output's gradient arrives
        (another backward in the same capture adds its own). Under `backward()`, after which no other can
        reach this output (it keeps no graph), the call then drops its inputs: the rest of the backward holds
        a norm's (B x features) gradients, not its input and output gradient (B x T x features each); a
        factored term keeps what it needs."""
        dtype = _compute_dtype(layer.params.values())
        with torch.no_grad():
            x = _first_tensor(call.args, call.kwargs)
            call.terms.append(layer.rule(layer.module, x, grad.detach().to(dtype), layer.params.keys()))
        if self._last_backward:
            call.args, call.kwargs = (), {}

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` as far as per-sample gradients need it: to every captured layer output, and to
        the parameters of layers that were not called (so that a parameter used outside its modules is still
        named). The called layers' parameters get no batch gradient: DP-SGD discards it, and skipping it
        saves the weight-gradient matmuls of the backward. The outputs are named by their autograd edges as
        the layers returned them: no tensor is kept alive, and an output changed in place later still gets
        the gradient of what its layer returned."""
        if not self._edges:
            loss.backward()
            return
        idle = list(
            dict.fromkeys(p for layer in self._layers if not layer.calls for p in layer.params.values())
        )
        # autograd.grad, not backward(inputs=): that would store a clone of each output's gradient in .grad
        self._last_backward = True
        try:
            grads = torch.autograd.grad(loss, [*self._edges, *idle], allow_unused=True)
        finally:
            self._last_backward = False
        for p, grad in zip(idle, grads[len(self._edges) :], strict=True):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad + grad

    @staticmethod
    def _verify(layer: _Layer, x: torch.Tensor, output: Any) -> None:
        """A module matched by class name only (RMSNorm) keeps its rule if its output is weight * normed(x);
        otherwise it gets the torch.func fallback, which is exact for any formula."""
        layer.verify = False
        with torch.no_grad():
            expected = layer.module.weight * llama_normed(layer.module, x)
        matches = isinstance(output, torch.Tensor) and expected.shape == output.shape
        if not (matches and torch.allclose(expected, output, rtol=1e-3, atol=1e-5)):
            layer.rule = None

    # ---- per-sample gradients ------------------------------------------------------------------------------
    def _contributions(self) -> dict[nn.Parameter, list[Contribution]]:
        """Every parameter's per-sample gradient terms, one per layer call, of the loss as back-propagated:
        `self._scale` (B for a mean loss) turns them into each sample's own, where they are used."""
        if self._parts is not None:
            return self._parts
        calls = [
            (layer, c)
            for layer in self._layers
            for c in layer.calls
            if c.terms or any(g is not None for g in c.grads)
        ]
        if not calls:
            raise RuntimeError("nothing was captured: run the forward and loss.backward() inside capture()")
        sizes = {(layer.name, c.batch) for layer, c in calls}
        if len({b for _, b in sizes}) > 1:
            seen = ", ".join(f"'{n}': {b}" for n, b in sorted(sizes))
            raise ValueError(
                f"layers saw different batch sizes in dim 0 of their inputs ({seen}); per-sample gradients "
                "read the batch from dim 0 of every layer's input: keep it there (no reshape of (B, T, D) to "
                "(B * T, D) before a layer)"
            )
        B = next(iter(sizes))[1]
        parts: dict[nn.Parameter, list[Contribution]] = {p: [] for p in self.params}
        for layer, call in calls:
            dtype = _compute_dtype(layer.params.values())
            sets = call.terms
            if not sets:
                x = _first_tensor(call.args, call.kwargs)
                grads = [
                    torch.zeros(shape, dtype=out_dtype, device=x.device) if g is None else g
                    for g, (shape, out_dtype) in zip(call.grads, call.out_meta, strict=True)
                ]
                if layer.rule is not None:  # (a layer with a rule and several outputs: the first's gradient)
                    sets = [layer.rule(layer.module, x, grads[0].to(dtype), layer.params.keys())]
                else:
                    sets = [self._vmap_rule(layer, call, grads, B)]
            for terms in sets:
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
        self._scale = float(B) if self.loss_reduction == "mean" else 1.0
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
        loss, in float32 (float64 for a float64 parameter). Materialises them whole, in every mode."""
        return {p: self._materialised(p) * self._scale for p in self.params}

    def _materialised(self, p: nn.Parameter) -> torch.Tensor:
        """The per-sample gradients of the loss as back-propagated (without `_scale`), built once."""
        if p not in self._dense:
            parts = self._contributions()[p]
            shape = (self.batch_size, *p.shape)
            if not parts:
                total = torch.zeros(shape, dtype=_compute_dtype([p]), device=p.device)
            else:
                dense = [
                    (part.materialise() if isinstance(part, Outer) else part).reshape(shape) for part in parts
                ]
                total = dense[0] if len(dense) == 1 else torch.stack(dense).sum(0)
            self._dense[p] = total
        return self._dense[p]

    def _sq_norms(self, p: nn.Parameter) -> torch.Tensor:
        """||g_i||^2 of one parameter, (B,), without `_scale`: a factored weight's by Gram matrices or by
        chunks of its per-sample gradients (as `mode` says), anything else from its per-sample gradients."""
        parts = self._contributions()[p]
        if not parts:
            return torch.zeros(self.batch_size, dtype=_compute_dtype([p]), device=p.device)
        if all(isinstance(part, Outer) for part in parts):
            ghost = self.mode == "ghost" or (self.mode == "mixed" and ghost_is_cheaper(parts))
            return ghost_sq_norms(parts) if ghost else instantiated_sq_norms(parts)
        return self._materialised(p).flatten(1).pow(2).sum(1)

    def _sq_layer_norms(self) -> dict[str, torch.Tensor]:
        """Squared per-sample gradient norms (B,) of each layer (see `per_layer_norms`), computed once."""
        if self._layer_sq is None:
            squares: dict[str, Any] = dict.fromkeys(self.layer_names, 0.0)
            for p in self.params:
                squares[self._group_of[p]] = squares[self._group_of[p]] + self._sq_norms(p)
            self._layer_sq = {name: sq * self._scale**2 for name, sq in squares.items()}
        return self._layer_sq

    def per_layer_norms(self) -> dict[str, torch.Tensor]:
        """Per-sample gradient norms (B,) of each layer, keyed by module path: a layer is the parameters a
        module owns itself (a tied parameter counts with the first owner). The units of per-layer clipping."""
        return {name: sq.sqrt() for name, sq in self._sq_layer_norms().items()}

    def per_sample_norms(self) -> torch.Tensor:
        """||g_i|| over all trainable parameters jointly, (B,)."""
        return sum(self._sq_layer_norms().values()).sqrt()

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
        norms = self.per_sample_norms()
        if self.clipping == "flat":
            flat = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            factors = dict.fromkeys(self.layer_names, flat)
        else:
            budget = max_grad_norm / math.sqrt(len(self.layer_names))
            factors = {
                name: (budget / (n + 1e-6)).clamp(max=1.0) for name, n in self.per_layer_norms().items()
            }
        # the clip factors times _scale weigh the back-propagated per-sample gradients, once per layer
        weights = {name: f * self._scale if self._scale != 1.0 else f for name, f in factors.items()}
        sums = {p: self._clipped_sum(p, weights[self._group_of[p]]) for p in self.params}
        for p in self.params:
            p.grad = None
        self.clear()
        return ClippedSum(sums, norms)

    def _clipped_sum(self, p: nn.Parameter, weights: torch.Tensor) -> torch.Tensor:
        """sum_i weights_i g_i: from the per-sample gradients where they were built whole, else from each
        factored term by one matmul."""
        dtype = _compute_dtype([p])
        weights = weights.to(dtype)
        if p in self._dense:
            return torch.tensordot(weights, self._dense[p], dims=1)
        terms = [
            part.weighted_sum(weights) if isinstance(part, Outer) else torch.tensordot(weights, part, dims=1)
            for part in self._contributions()[p]
        ]
        if not terms:
            return torch.zeros(p.shape, dtype=dtype, device=p.device)
        total = terms[0].reshape(p.shape)
        for term in terms[1:]:
            total = total + term.reshape(p.shape)
        return total

    def clear(self) -> None:
        """Drop every captured activation, gradient and result (also the error path of a step)."""
        for layer in self._layers:
            layer.calls.clear()
        self._edges: list[GradientEdge] = []  # where each hooked output's gradient arrives
        self._parts: dict[nn.Parameter, list[Contribution]] | None = None
        self._dense: dict[nn.Parameter, torch.Tensor] = {}
        self._layer_sq: dict[str, torch.Tensor] | None = None
        self.batch_size: int | None = None
        self._scale = 1.0
