"""BaseFinetuning and BackboneFinetuning: Lightning's freeze/unfreeze callbacks. `freeze_before_training` runs
in `setup` (before `configure_optimizers`, which should take only the parameters that require grad);
`finetune_function` runs at each epoch's start and may unfreeze modules into a new param group of the running
optimizer. The param groups it added are kept in the callback's state."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module, ModuleDict
from torch.nn.modules.batchnorm import _BatchNorm

from callbacks.base import Callback
from trainer.core.logging import log

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer

Modules = Module | Iterable[Any]


def multiplicative(epoch: int) -> float:
    return 2.0


class BaseFinetuning(Callback):
    """Subclass with `freeze_before_training(module)` and `finetune_function(module, epoch, optimizer)`; the
    static helpers freeze, unfreeze and add param groups."""

    def __init__(self) -> None:
        # per optimizer index: its param groups with parameter names in place of the parameters (Lightning's
        # record, from which a resumed fit rebuilds the groups: `restore_param_groups`)
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"internal_optimizer_metadata": self._internal_optimizer_metadata}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._internal_optimizer_metadata = state["internal_optimizer_metadata"]

    def restore_param_groups(self, trainer: Trainer, state: dict[str, Any]) -> None:
        """A resumed fit, before the optimizer's state loads: this callback's saved state, and the optimizers'
        param groups as it recorded them (those it added during the run included), as Lightning's
        `on_fit_start` puts them back before its optimizer state loads."""
        self.load_state_dict(state)
        named = dict(trainer.module.named_parameters())
        for idx, optimizer in enumerate(trainer.optimizers):
            if idx in self._internal_optimizer_metadata:
                groups = self._internal_optimizer_metadata[idx]
                optimizer.param_groups = self._apply_mapping_to_param_groups(groups, named)

    @staticmethod
    def flatten_modules(modules: Modules) -> list[Module]:
        """The leaf modules of `modules` (a module or nested iterables of them) and the parents that hold
        parameters of their own."""
        if isinstance(modules, ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable):
            found = iter([m for sub in modules for m in BaseFinetuning.flatten_modules(sub)])
        else:
            found = modules.modules()
        return [m for m in found if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True, requires_grad: bool = True) -> Generator:
        """The parameters of `modules` whose requires_grad is `requires_grad` (BatchNorm's left out unless
        `train_bn`)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and not train_bn:
                continue
            # not recursive: a parent with parameters of its own is listed beside its children
            for param in mod.parameters(recurse=False):
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze every parameter of `modules` (BatchNorm layers track running statistics again)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: Module) -> None:
        """Freeze `module`'s own parameters (a BatchNorm layer also stops tracking running statistics)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze `modules`; with `train_bn` their BatchNorm layers stay trainable."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(mod)
            else:
                BaseFinetuning.freeze_module(mod)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable) -> list:
        """The `params` not already in one of `optimizer`'s groups (a warning names the others)."""
        out, removed = [], []
        for param in params:
            held = any(torch.equal(p, param) for group in optimizer.param_groups for p in group["params"])
            (removed if held else out).append(param)
        if removed:
            log.warning(
                "The provided params to be frozen already exist within another group of this optimizer. Those "
                "parameters will be skipped.\nHINT: Did you init your optimizer in `configure_optimizer` as such:\n "
                f"{type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) "
            )
        return out

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Modules,
        optimizer: torch.optim.Optimizer,
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreeze `modules` and add their parameters to `optimizer` as a new group, at `lr` (default: the
        first group's LR / `initial_denom_lr`)."""
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        params = BaseFinetuning.filter_on_optimizer(optimizer, params)
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self.freeze_before_training(module)

    @staticmethod
    def _apply_mapping_to_param_groups(groups: list[dict[str, Any]], mapping: dict) -> list[dict[str, Any]]:
        """`groups` with each parameter replaced by `mapping[parameter]` (its name)."""
        return [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [mapping[p] for p in g["params"]]}
            for g in groups
        ]

    def _store(
        self, module: TrainModule, idx: int, num_param_groups: int, groups: list[dict[str, Any]]
    ) -> None:
        """Remember optimizer `idx`'s groups by parameter name: all at first, then the ones added since."""
        mapping = {p: n for n, p in module.named_parameters()}
        if idx not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[idx] = self._apply_mapping_to_param_groups(groups, mapping)
        elif num_param_groups != len(groups):
            added = self._apply_mapping_to_param_groups(groups[num_param_groups:], mapping)
            self._internal_optimizer_metadata[idx].extend(added)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        for idx, optimizer in enumerate(trainer.optimizers):
            num_param_groups = len(optimizer.param_groups)
            self.finetune_function(module, trainer.current_epoch, optimizer)
            self._store(module, idx, num_param_groups, optimizer.param_groups)

    def finetune_function(self, pl_module: TrainModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        """Override: unfreeze what should train from `epoch` on."""
        raise NotImplementedError(
            f"{type(self).__name__} must define finetune_function(pl_module, epoch, optimizer)"
        )

    def freeze_before_training(self, pl_module: TrainModule) -> None:
        """Override: freeze what should not train at first."""
        raise NotImplementedError(f"{type(self).__name__} must define freeze_before_training(pl_module)")


class BackboneFinetuning(BaseFinetuning):
    """Freezes the module's `backbone` until `unfreeze_backbone_at_epoch`, then trains it in a group of its own
    whose LR starts at `backbone_initial_lr` (default: the current LR x `backbone_initial_ratio_lr`) and is
    multiplied by `lambda_func(epoch + 1)` each epoch, capped at the current LR when `should_align`."""

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: float | None = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
    ) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous_backbone_lr = state["previous_backbone_lr"]
        super().load_state_dict(state)

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if not isinstance(getattr(module, "backbone", None), Module):
            raise ValueError(
                f"BackboneFinetuning needs the module's backbone: {type(module).__name__} has no nn.Module "
                "`backbone` attribute"
            )
        super().setup(trainer, module, stage)

    def freeze_before_training(self, pl_module: TrainModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: TrainModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            initial = self.backbone_initial_lr
            initial_backbone_lr = current_lr * self.backbone_initial_ratio_lr if initial is None else initial
            self.previous_backbone_lr = initial_backbone_lr
            self.unfreeze_and_add_param_group(
                pl_module.backbone,
                optimizer,
                initial_backbone_lr,
                train_bn=self.train_bn,
                initial_denom_lr=self.initial_denom_lr,
            )
            self._say(current_lr, initial_backbone_lr)
        elif epoch > self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            next_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and next_lr > current_lr:
                next_lr = current_lr
            optimizer.param_groups[-1]["lr"] = next_lr
            self.previous_backbone_lr = next_lr
            self._say(current_lr, next_lr)

    def _say(self, current_lr: float, backbone_lr: float) -> None:
        if self.verbose:
            log.info(
                f"Current lr: {round(current_lr, self.rounding)}, Backbone lr: {round(backbone_lr, self.rounding)}"
            )
