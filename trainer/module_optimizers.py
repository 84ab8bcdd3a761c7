"""The TrainModule's optimizer methods under Lightning's names and meanings: `optimizers()`, `lr_schedulers()`,
`toggle_optimizer`, and manual optimization's `automatic_optimization = False`, `manual_backward` and
`clip_gradients`. What they drive lives in the fit's loop (trainer/loop/manual_step.py); the module reaches it
through its Trainer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.loop.manual_step import ManualFitLoop
    from trainer.trainer import Trainer


class ModuleOptimizers:
    """Mixed into TrainModule: the optimizer side of Lightning's LightningModule."""

    trainer: Trainer
    _automatic_optimization = True

    @property
    def automatic_optimization(self) -> bool:
        """True: the Trainer does each step's backward, clipping and optimizer step. False (Lightning's manual
        optimization): `training_step` does them, with `manual_backward(loss)` and the optimizers of
        `self.optimizers()`; every `opt.step()` counts a global step, and several optimizers are allowed."""
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, automatic: bool) -> None:
        self._automatic_optimization = bool(automatic)

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The fit's optimizer, or a list when there are several (Lightning's). Under manual optimization each is
        wrapped, so that its `step()` runs the precision's step between Lightning's hooks and counts a global
        step (`use_pl_optimizer=False`: the optimizers themselves); else the optimizer the Trainer steps."""
        manual = self.trainer.manual_optimization
        if manual is None:
            return self.trainer.optimizer
        optimizers = manual.lightning_optimizers if use_pl_optimizer else manual.optimizers
        return optimizers[0] if len(optimizers) == 1 else list(optimizers)

    def lr_schedulers(self) -> Any:
        """The learning-rate scheduler in use: yours from `configure_optimizers`, else the Trainer's. Under
        manual optimization (which you step yourself, as in Lightning): one alone, several as a list, or None."""
        if self.trainer.manual_optimization is None:
            return self.trainer.lr_scheduler
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        return None if not schedulers else schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The backward of `loss` in a manually optimized `training_step` (`args`/`kwargs` go to
        `Tensor.backward`), with the precision's loss scaling and the strategy's gradient sync, between the
        on_before_backward and on_after_backward hooks."""
        self._manual("manual_backward").backward(loss, *args, **kwargs)

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip the gradients of `optimizer`'s parameters, by their global norm ("norm", the default) or each
        value ("value"), over every shard and rank (fp16 gradients are unscaled first); None or 0: no clipping."""
        self._manual("clip_gradients").clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only `optimizer`'s parameters require gradients until `untoggle_optimizer`: the parameters of the
        fit's other optimizers are switched off (their settings kept to be restored), as in Lightning."""
        saved: dict[torch.Tensor, bool] = {}
        for other in self.trainer.optimizers:
            for param in _params(other):
                if param not in saved:
                    saved[param] = param.requires_grad
                    param.requires_grad = False
        for param in _params(optimizer):
            param.requires_grad = saved[param]
        self._param_requires_grad_state = saved

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Restore what `toggle_optimizer(optimizer)` switched off: the other optimizers' parameters."""
        saved = getattr(self, "_param_requires_grad_state", {})
        for other in self.trainer.optimizers:
            if other.param_groups is not optimizer.param_groups:
                for param in _params(other):
                    if param in saved:
                        param.requires_grad = saved[param]
        self._param_requires_grad_state = {}

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """`toggle_optimizer` for the block, `untoggle_optimizer` after it (also when it raises)."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def _manual(self, method: str) -> ManualFitLoop:
        manual = self.trainer.manual_optimization
        if manual is None:
            why = (
                "set `self.automatic_optimization = False` (under automatic optimization the Trainer does it)"
                if self.automatic_optimization
                else "call it from training_step during a fit"
            )
            raise RuntimeError(f"{method} is for manual optimization: {why}")
        return manual


def _params(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every parameter of `optimizer`'s groups (an optimizer or the wrapper `optimizers()` returns)."""
    for group in optimizer.param_groups:
        yield from group["params"]
