"""Lightning's manual optimization (`automatic_optimization = False`): each batch's `training_step` does its own
backward (`manual_backward`) and steps its optimizers (`self.optimizers()`, one or several, with their
schedulers stepped by hand); the loop calls it once per batch and does no backward, step or zero_grad itself.
As in Lightning, every `opt.step()` of any optimizer counts a global step (so `max_steps` and checkpoints count
them), while logging and validation intervals count batches. The Trainer flags that would do what the module now
does (clipping, accumulation, the Trainer's LR schedule) are refused before any process starts."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from trainer.core.fused_optim import prefer_fused
from trainer.flags import LoopFlags
from trainer.loop.fit_loop import FitLoop
from trainer.loop.optim_config import SchedulerConfig, configured_optimizers
from trainer.loop.step_log import Throughput, batch_size
from trainer.module import TrainModule

CLIP_ALGORITHMS = ("norm", "value")


def check_manual_optimization(module: TrainModule, flags: LoopFlags, fault_tolerance: Any) -> None:
    """Before any process starts: a manually optimized module clips, accumulates and schedules itself, so the
    Trainer flags that would do it are refused in one line (Lightning refuses the first two the same way)."""
    if module.automatic_optimization:
        return
    name = type(module).__name__
    if flags.gradient_clip_val:
        raise ValueError(
            f"gradient_clip_val={flags.gradient_clip_val} with {name}'s manual optimization: the Trainer does not "
            "clip; allowed: no gradient_clip_val, and `self.clip_gradients(opt, gradient_clip_val=...)` in "
            "training_step"
        )
    if flags.accumulate_grad_batches != 1:
        raise ValueError(
            f"accumulate_grad_batches={flags.accumulate_grad_batches} with {name}'s manual optimization: the "
            "Trainer does not accumulate; allowed: 1, and `opt.step()` every k batches in training_step"
        )
    if flags.lr_schedule != "constant" or flags.warmup_steps:
        raise ValueError(
            f"lr_schedule={flags.lr_schedule!r}, warmup_steps={flags.warmup_steps} with {name}'s manual "
            "optimization: the Trainer steps no scheduler; allowed: 'constant', 0, and your schedulers from "
            "configure_optimizers stepped in training_step (`self.lr_schedulers()`)"
        )
    if fault_tolerance is not None:
        raise ValueError(
            f"fault_tolerance with {name}'s manual optimization: the replica groups average and commit the "
            "Trainer's own optimizer step; allowed: automatic optimization, or no fault_tolerance"
        )


class ManualFitLoop(FitLoop):
    """A fit whose module optimizes manually: per batch one `training_step`, which calls back into this loop
    through the module's `manual_backward`, `clip_gradients` and its optimizers' `step`."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.optimizers: list[torch.optim.Optimizer] = []  # as configured, set up by the strategy
        self.lightning_optimizers: list[ManualOptimizer] = []  # what the module's `optimizers()` returns
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self._unscaled: set[int] = set()  # fp16: optimizers whose gradients are unscaled until they step

    # ---- set-up: every optimizer and scheduler, none of the Trainer's own ---------------------------
    def setup_optimizer(self) -> None:
        trainer = self.trainer
        optimizers, self.lr_scheduler_configs = configured_optimizers(
            self.module.configure_optimizers(), manual=True
        )
        for optimizer in optimizers:
            if isinstance(optimizer, torch.optim.LBFGS):
                raise TypeError(
                    "LBFGS re-evaluates its closure inside step(), which a manual step runs once before it; "
                    "allowed with manual optimization: optimizers whose step() takes no closure"
                )
        self.optimizers = [trainer.strategy.setup_optimizer(prefer_fused(o)) for o in optimizers]
        self.lightning_optimizers = [ManualOptimizer(o, self) for o in self.optimizers]
        # what callbacks and views written for one optimizer read: the first (lr_scheduler_configs has all)
        trainer.optimizer = self.optimizers[0]
        configs = self.lr_scheduler_configs
        trainer.lr_scheduler = configs[0].scheduler if configs else None
        trainer._scheduler_config = trainer._schedule = None

    # ---- one batch -----------------------------------------------------------------------------------
    def _optimizer_step(self, window: list[Any], meter: Throughput, started: float) -> dict[str, Any]:
        """`training_step` of the batch, which steps what it steps; then its output as Lightning hands it to
        on_train_batch_end (a returned loss detached), and the batch counted."""
        trainer, module = self.trainer, self.module
        s, strategy = trainer.state, trainer.strategy
        (batch,) = window  # accumulate_grad_batches is 1 (check_manual_optimization)
        batch_idx = s.batches_in_epoch
        if self.first_train_batch is None:
            self.first_train_batch = batch
        batch = strategy.to_device(batch)  # the hooks see it on the step's device, as in Lightning
        trainer._dispatch.step("on_train_batch_start", (batch, batch_idx))
        samples, tokens = batch_size(batch)
        s.samples_seen += samples
        s.tokens_seen += tokens or 0
        log_now = (s.manual_batches + 1) % trainer.log_every_n_steps == 0
        steps_before = s.global_step
        output = strategy.manual_training_step(module, strategy.batch_to_device(batch), batch_idx)
        outputs = _step_outputs(output)
        loss = outputs.get("loss")
        self.step_loss = loss
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:  # the fit's end checks it is finite
            self.losses.record(loss, s.global_step)
        s.productive_s += time.perf_counter() - started
        s.batches_in_epoch += 1
        s.manual_batches += 1
        if self.progress is not None:  # a batch took any number of steps; _end_step moves the bar one
            self.progress.update(s.global_step - steps_before - 1)
        # the batch's values reach the loggers and callback_metrics before on_train_batch_end reads them, as
        # Lightning's and the automatic step's; _end_step then takes what the batch-end hooks log
        self.step_logged = log_now
        self._take_step_values()
        return outputs

    def _stepped(self) -> int:
        return self.trainer.state.manual_batches

    # ---- what the module's methods reach -------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """`manual_backward`: on_before_backward (callbacks, then module), the strategy's backward (loss scaling, gradient
        sync), then on_after_backward (callbacks, then module), as Lightning's order is."""
        trainer = self.trainer
        trainer._dispatch.step("on_before_backward", (loss,))
        with trainer.clock.phase("backward"):
            trainer.strategy.manual_backward(loss, *args, **kwargs)
        trainer._dispatch.step("on_after_backward")

    def step_optimizer(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> Any:
        """A wrapped optimizer's `step`: the closure, fp16's unscaling, on_before_optimizer_step, then the
        precision's step (a callback's `skip_optimizer_step` skips the update only); one global step more
        either way, as Lightning counts it. Returns what the closure returned."""
        trainer, s = self.trainer, self.trainer.state
        result = closure() if closure is not None else None
        self._unscale(optimizer)
        self.skip_reason = None
        trainer._dispatch.step("on_before_optimizer_step", (optimizer,))
        with trainer.clock.phase("optimizer"):
            if self.skip_reason is not None:
                trainer.strategy.precision.skip_step()
                stepped = False
            else:  # False: fp16's loss scaler dropped the update for inf/nan gradients
                stepped = trainer.strategy.optimizer_step(optimizer)
        self._unscaled.discard(id(optimizer))
        s.skipped_steps += not stepped
        s.global_step += 1
        return result

    def clip_gradients(self, optimizer: Any, value: float | None, algorithm: str | None) -> None:
        """`clip_gradients`: `optimizer`'s parameters' gradients clipped to `value` by `algorithm`."""
        algorithm = "norm" if algorithm is None else str(algorithm).lower()
        if algorithm not in CLIP_ALGORITHMS:
            raise ValueError(f"gradient_clip_algorithm={algorithm!r} is invalid; allowed: 'norm', 'value'")
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"gradient_clip_val={value!r} is invalid; allowed: an int or a float")
        if value <= 0:
            return
        optimizer = getattr(optimizer, "optimizer", optimizer)  # the wrapper's, or one as configured
        self._unscale(optimizer)
        strategy = self.trainer.strategy
        strategy.clip_gradients(strategy.trained_parameters(optimizer), float(value), algorithm)

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16: `optimizer`'s gradients back to true values before they are clipped or read by hooks, once
        per step (the scaler refuses a second time)."""
        precision = self.trainer.strategy.precision
        if precision.scaler is not None and id(optimizer) not in self._unscaled:
            precision.unscale_gradients(optimizer)
            self._unscaled.add(id(optimizer))


class ManualOptimizer:
    """What the module's `optimizers()` returns under manual optimization (Lightning's `LightningOptimizer`):
    `step` runs between Lightning's hooks and counts a global step; every other attribute is the optimizer's
    own (`zero_grad`, `param_groups`, `state`, ...). `.optimizer` is the optimizer itself."""

    def __init__(self, optimizer: torch.optim.Optimizer, loop: ManualFitLoop) -> None:
        self._optimizer, self._loop = optimizer, loop

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of the optimizer's parameters; `closure` (which usually computes a loss and calls
        `manual_backward`) runs first and its result is returned."""
        if closure is not None and not callable(closure):
            raise TypeError(f"optimizer.step(closure={closure!r}): the closure must be callable")
        return self._loop.step_optimizer(self._optimizer, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        """Lightning's: only this optimizer's parameters require gradients inside the block; `sync_grad=False`
        keeps its backwards' gradients on each rank (no data-parallel sync), for accumulating batches."""
        strategy = self._loop.trainer.strategy
        with strategy.accumulation_context(is_last_micro_batch=sync_grad):
            with self._loop.module.toggled_optimizer(self):
                yield
        if not sync_grad:  # a sharded strategy's sync is a setting the context above left off
            strategy.accumulation_context(is_last_micro_batch=True)

    def __getattr__(self, name: str) -> Any:
        if name in ("_optimizer", "_loop"):  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def __repr__(self) -> str:
        return f"ManualOptimizer({self._optimizer!r})"


def _step_outputs(output: Any) -> dict[str, Any]:
    """What Lightning hands on_train_batch_end from a manual `training_step`: its dict (a copy) or {"loss":
    tensor}, the loss detached; {} for None."""
    if output is None:
        return {}
    if isinstance(output, torch.Tensor):
        return {"loss": output.detach()}
    if isinstance(output, Mapping):
        outputs = dict(output)
        if isinstance(outputs.get("loss"), torch.Tensor):
            outputs["loss"] = outputs["loss"].detach()
        return outputs
    raise TypeError(
        f"training_step returned {type(output).__name__} under manual optimization; allowed: a tensor, a dict "
        "or None"
    )
