"""ModelPruning: prune parameters with torch.nn.utils.prune at epoch ends, permanently at the fit's end
(Lightning's)."""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.utils.prune as torch_prune
from torch import nn
from torch.utils.hooks import RemovableHandle

from callbacks.base import Callback
from callbacks.pruned_state import fold_pruned_state
from trainer.core.logging import rank_zero_info
from trainer.module import TrainModule

if TYPE_CHECKING:
    from trainer.trainer import Trainer

_FUNCTIONS = {
    "ln_structured": torch_prune.ln_structured,
    "l1_unstructured": torch_prune.l1_unstructured,
    "random_structured": torch_prune.random_structured,
    "random_unstructured": torch_prune.random_unstructured,
}
_METHODS = {
    "ln_structured": torch_prune.LnStructured,
    "l1_unstructured": torch_prune.L1Unstructured,
    "random_structured": torch_prune.RandomStructured,
    "random_unstructured": torch_prune.RandomUnstructured,
}
# modules that only hold others: their parameters are pruned through the modules they hold
_CONTAINERS = (TrainModule, nn.Sequential, nn.ModuleList, nn.ModuleDict)
ParameterList = Sequence[tuple[nn.Module, str]]


class ModelPruning(Callback):
    """At each training epoch's end (or, with `prune_on_train_epoch_end=False`, each validation's end inside the
    fit), prune `amount` (a fraction, a count, or a function of the epoch) of `parameters_to_prune`
    ((module, "weight"/"bias") pairs; none given: every `parameter_names` parameter of the module) with
    `pruning_fn` (a name of torch's built-in methods or a `BasePruningMethod` subclass), over all of them at
    once (`use_global_unstructured`) or per tensor. `apply_pruning` (a bool or a function of the epoch) says
    whether; with `use_lottery_ticket_hypothesis` the kept weights go back to their values at the fit's start
    (`resample_parameters`: to a fresh initialisation). With `make_pruning_permanent` the masks are applied and
    removed when training ends, and every checkpoint holds the pruned tensors under their own names (as
    Lightning's do), so it loads into the unpruned model. `verbose` 1 logs the overall sparsity, 2 per tensor."""

    PARAMETER_NAMES = ("weight", "bias")

    def __init__(
        self,
        pruning_fn: Callable | str,
        parameters_to_prune: ParameterList = (),
        parameter_names: list[str] | None = None,
        use_global_unstructured: bool = True,
        amount: int | float | Callable[[int], int | float] = 0.5,
        apply_pruning: bool | Callable[[int], bool] = True,
        make_pruning_permanent: bool = True,
        use_lottery_ticket_hypothesis: bool | Callable[[int], bool] = True,
        resample_parameters: bool = False,
        pruning_dim: int | None = None,
        pruning_norm: int | None = None,
        verbose: int = 0,
        prune_on_train_epoch_end: bool = True,
    ) -> None:
        self._use_global_unstructured = use_global_unstructured
        self._parameters_to_prune = parameters_to_prune
        self._use_lottery_ticket_hypothesis = use_lottery_ticket_hypothesis
        self._resample_parameters = resample_parameters
        self._prune_on_train_epoch_end = prune_on_train_epoch_end
        self._parameter_names = parameter_names or self.PARAMETER_NAMES
        self._apply_pruning = apply_pruning
        self._make_pruning_permanent = make_pruning_permanent
        self._global_kwargs: dict[str, Any] = {}
        self._original_layers: dict[int, tuple[nn.Module, list[tuple[int, str]]]] | None = None
        self._folding: list[RemovableHandle] = []
        for name in self._parameter_names:
            if name not in self.PARAMETER_NAMES:
                raise ValueError(f"parameter_names has {name!r}; allowed: {', '.join(self.PARAMETER_NAMES)}")
        self.pruning_fn = self._resolve(pruning_fn, pruning_dim, pruning_norm)
        if isinstance(amount, bool) or not (isinstance(amount, (int, float)) or callable(amount)):
            raise ValueError(
                f"amount={amount!r} is invalid; allowed: an int, a float or a function of the epoch"
            )
        self.amount = amount
        if verbose not in (0, 1, 2):
            raise ValueError(f"verbose={verbose!r} is invalid; allowed: 0, 1 or 2")
        self._verbose = verbose

    def _resolve(self, pruning_fn: Any, dim: int | None, norm: int | None) -> Any:
        """The method class (global pruning) or the pruning function with its options bound (per tensor)."""
        if isinstance(pruning_fn, str):
            name = pruning_fn.lower()
            if name not in _FUNCTIONS:
                raise ValueError(
                    f"pruning_fn={pruning_fn!r} is unknown; allowed: {', '.join(map(repr, _FUNCTIONS))}"
                )
            options: dict[str, Any] = {}
            if name.endswith("_structured"):
                if dim is None:
                    raise ValueError(
                        f"pruning_fn={name!r} needs pruning_dim; allowed: the dimension to prune along"
                    )
                if name == "ln_structured":
                    if norm is None:
                        raise ValueError(
                            "pruning_fn='ln_structured' needs pruning_norm; allowed: the norm's order"
                        )
                    options["n"] = norm
                options["dim"] = dim
            if not self._use_global_unstructured:
                self._pruning_method_name = name
                return functools.partial(_FUNCTIONS[name], **options)
            self._global_kwargs = options
            method = _METHODS[name]
        elif inspect.isclass(pruning_fn) and issubclass(pruning_fn, torch_prune.BasePruningMethod):
            if not self._use_global_unstructured:
                raise ValueError(
                    f"pruning_fn={pruning_fn.__name__} (a BasePruningMethod) needs use_global_unstructured=True"
                )
            method = pruning_fn
        else:
            raise ValueError(
                f"pruning_fn={pruning_fn!r} is invalid; allowed: one of {', '.join(map(repr, _FUNCTIONS))} or a "
                "BasePruningMethod subclass (the class, not an instance)"
            )
        self._pruning_method_name = method.__name__
        if method.PRUNING_TYPE != "unstructured":
            raise ValueError(
                f"use_global_unstructured=True needs an unstructured method; {method.__name__} is "
                f"{method.PRUNING_TYPE}"
            )
        return method

    def filter_parameters_to_prune(self, parameters_to_prune: ParameterList = ()) -> ParameterList:
        """Override to choose which of the (module, name) pairs are pruned."""
        return parameters_to_prune

    def make_pruning_permanent(self, module: nn.Module) -> None:
        """Apply the masks of every pruned tensor in `module` and remove the pruning (its hooks and buffers)."""
        for sub in module.modules():
            for key, hook in list(sub._forward_pre_hooks.items()):
                if isinstance(hook, torch_prune.BasePruningMethod):
                    hook.remove(sub)
                    del sub._forward_pre_hooks[key]

    def apply_lottery_ticket_hypothesis(self) -> None:
        """Put the kept weights back to their values at the fit's start (or to a fresh initialisation with
        `resample_parameters`); the masks stay."""
        for original, names in self._original_layers.values():
            source = original
            if self._resample_parameters and callable(getattr(original, "reset_parameters", None)):
                source = copy.deepcopy(original)
                source.reset_parameters()
            for i, name in names:
                module = self._parameters_to_prune[i][0]
                target = getattr(module, f"{name}_orig", None)
                target = getattr(module, name) if target is None else target
                value = getattr(source, name)
                if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
                    with torch.no_grad():
                        target.copy_(value)

    def apply_pruning(self, amount: int | float) -> None:
        """Prune `amount` of the parameters (globally or per tensor), logging the sparsity when `verbose`."""
        before = [_pruned_stats(m, n) for m, n in self._parameters_to_prune] if self._verbose else []
        if self._use_global_unstructured:
            self._global_kwargs["amount"] = amount
            accepted = set(inspect.signature(self.pruning_fn).parameters) - {"self"}
            kwargs = {k: v for k, v in self._global_kwargs.items() if k in accepted}
            torch_prune.global_unstructured(
                self._parameters_to_prune, pruning_method=self.pruning_fn, **kwargs
            )
        else:
            for module, name in self._parameters_to_prune:
                self.pruning_fn(module, name=name, amount=amount)
        if self._verbose:
            self._log_sparsity(before, [_pruned_stats(m, n) for m, n in self._parameters_to_prune], amount)

    def _log_sparsity(
        self, before: list[tuple[int, int]], after: list[tuple[int, int]], amount: float
    ) -> None:
        total = sum(n for _, n in after)
        was, now = sum(z for z, _ in before), sum(z for z, _ in after)
        rank_zero_info(
            f"Applied `{self._pruning_method_name}`. Pruned: {was}/{total} ({was / total:.2%}) -> "
            f"{now}/{total} ({now / total:.2%})"
        )
        if self._verbose == 2:
            for (module, name), (z0, n0), (z1, n1) in zip(
                self._parameters_to_prune, before, after, strict=True
            ):
                rank_zero_info(
                    f"Applied `{self._pruning_method_name}` to `{module!r}.{name}` with amount={amount}. Pruned: "
                    f"{z0} ({z0 / n0:.2%}) -> {z1} ({z1 / n1:.2%})"
                )

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if stage != "fit":
            return
        sanitized = self.sanitize_parameters_to_prune(
            module, self._parameters_to_prune, self._parameter_names
        )
        self._parameters_to_prune = self.filter_parameters_to_prune(sanitized)
        if self._use_lottery_ticket_hypothesis:
            # one copy of each module's values at the start, with the indices of its pruned names
            self._original_layers = {}
            for i, (layer, name) in enumerate(self._parameters_to_prune):
                entry = self._original_layers.setdefault(id(layer), (copy.deepcopy(layer), []))
                entry[1].append((i, name))
        if self._make_pruning_permanent and not self._folding:
            self._folding = fold_pruned_state(self._parameters_to_prune)

    def _run_pruning(self, epoch: int) -> None:
        prune = self._apply_pruning(epoch) if callable(self._apply_pruning) else self._apply_pruning
        amount = self.amount(epoch) if callable(self.amount) else self.amount
        if not prune or not amount:
            return
        self.apply_pruning(amount)
        lottery = self._use_lottery_ticket_hypothesis
        if lottery(epoch) if callable(lottery) else lottery:
            self.apply_lottery_ticket_hypothesis()

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._prune_on_train_epoch_end:
            self._run_pruning(module.current_epoch)

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if trainer.fitting and not trainer.sanity_checking and not self._prune_on_train_epoch_end:
            self._run_pruning(module.current_epoch)

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._make_pruning_permanent:
            self.make_pruning_permanent(module)
            for handle in self._folding:
                handle.remove()
            self._folding = []

    @staticmethod
    def sanitize_parameters_to_prune(
        pl_module: nn.Module, parameters_to_prune: ParameterList = (), parameter_names: Sequence[str] = ()
    ) -> ParameterList:
        """`parameters_to_prune` checked against the module, or, when empty, every `parameter_names` parameter
        of its layers."""
        names = parameter_names or ModelPruning.PARAMETER_NAMES
        layers = [m for m in pl_module.modules() if not isinstance(m, _CONTAINERS)]
        if not parameters_to_prune:
            return [(m, n) for n in names for m in layers if isinstance(getattr(m, n, None), nn.Parameter)]
        pairs = isinstance(parameters_to_prune, (list, tuple)) and all(
            isinstance(p, (list, tuple))
            and len(p) == 2
            and isinstance(p[0], nn.Module)
            and isinstance(p[1], str)
            for p in parameters_to_prune
        )
        if not pairs:
            raise ValueError(
                "parameters_to_prune is invalid; allowed: a list of (nn.Module, parameter name) pairs, or empty for all"
            )
        missing_modules = [m for m, _ in parameters_to_prune if not any(m is layer for layer in layers)]
        missing_names = [n for m, n in parameters_to_prune if m not in missing_modules and not hasattr(m, n)]
        if missing_modules or missing_names:
            raise ValueError(
                f"parameters_to_prune names what the module does not have: modules {missing_modules}, "
                f"parameters {missing_names}"
            )
        return parameters_to_prune


def _pruned_stats(module: nn.Module, name: str) -> tuple[int, int]:
    """(pruned elements, elements) of a tensor's mask; (0, 1) before it is pruned."""
    mask = getattr(module, f"{name}_mask", None)
    return (0, 1) if mask is None else (int((mask == 0).sum()), mask.numel())
