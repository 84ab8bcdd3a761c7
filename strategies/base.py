"""Strategy: the one interface every parallelism plug-in implements.

The Trainer calls these methods in the order of DESIGN.md's "flow of one step" and never asks which
strategy it holds. The defaults here are those of one process on one device; a distributed strategy
overrides what differs (wrapping, collectives, gradient sync, which ranks write checkpoint files).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from strategies.checkpoint_io import CheckpointIO, Optimizers, read_checkpoint
from strategies.checkpoint_io.sharded_state import ShardedState
from strategies.checkpoint_io.whole_files import WholeFiles
from strategies.collectives import check_reduce_op
from strategies.gradients import _grads, scale_
from strategies.parallel_dims import check_group_name
from strategies.step_output import StepOutput, combine_micro_batches, unpack_loss
from strategies.step_skip import DECLARATION, may_return_none
from strategies.techniques.activation_checkpointing import check_mode, checkpoint_blocks, transformer_blocks
from strategies.techniques.compile_blocks import compile_units
from strategies.techniques.ep.experts import expert_modules, update_expert_biases
from trainer.core.dtensors import local_part
from trainer.core.precision import NO_CONTEXT, Precision
from trainer.core.timing import PhaseClock
from trainer.core.tree import apply_to_tensors
from trainer.data.distributed import shard_loader


class Strategy:
    """How the work of a run is spread over processes and devices (default: one process, one device)."""

    name = "base"
    # phases (see trainer.core.timing) in which a rank waits for no other rank: its own speed shows there
    local_phases: tuple[str, ...] = ("data", "forward", "optimizer")

    def __init__(self) -> None:
        self.accelerator = "cpu"
        self.devices = 1
        self.num_nodes = 1
        self.precision = Precision("32")
        self.device_ids: list[int] | None = None  # Lightning's devices=[i, ...]: the GPU of each local rank
        self._device = torch.device("cpu")
        self.clock = PhaseClock()  # time per phase of the step, read by callbacks
        self.activation_checkpointing: str | None = None  # None, "full" or "selective"
        self.compile: str | None = None  # a torch.compile mode, or None: eager
        self._expert_modules: list[nn.Module] = []  # the model's, recorded by prepare_blocks
        self.checkpoint_io: CheckpointIO = WholeFiles()  # the layout it writes
        # the fit's on_before_backward hooks (callbacks', then the module's), set by the fit loop
        self.before_backward: Callable[[torch.Tensor], None] | None = None

    # ---- set-up ----------------------------------------------------------------------------------
    def configure(
        self,
        accelerator: str,
        devices: int,
        num_nodes: int,
        precision: Precision,
        device_ids: list[int] | None = None,
    ) -> None:
        """Receive the Trainer's validated flags, then `check_configuration` (before any process starts).
        `device_ids` are the GPU indices of `devices=[i, ...]` (None: local rank r uses `cuda:r`)."""
        self.accelerator, self.devices, self.num_nodes = accelerator, devices, num_nodes
        self.precision, self.device_ids = precision, device_ids
        self.check_configuration()

    def check_configuration(self) -> None:
        """Raise a one-line error if the configured flags don't fit this strategy (subclasses extend it)."""

    def set_block_options(self, activation_checkpointing: str | None, compile: str | None) -> None:
        """The Trainer's `activation_checkpointing` and `compile` (a mode) flags, before `configure`. A
        strategy built with its own `activation_checkpointing` keeps it; the Trainer's must then agree."""
        check_mode(activation_checkpointing)
        own = self.activation_checkpointing
        if own and activation_checkpointing and own != activation_checkpointing:
            raise ValueError(
                f"Trainer activation_checkpointing={activation_checkpointing!r} but {type(self).__name__} was built "
                f"with activation_checkpointing={own!r}; allowed: set it in one place, or the same in both"
            )
        self.activation_checkpointing = own or activation_checkpointing
        self.compile = compile

    def launch(self, function: Any, *args: Any) -> Any:
        """Run `function(*args)` in every process of the job and return rank zero's result."""
        return function(*args)

    def check_module(self, module: nn.Module) -> None:
        """Raise a one-line error if `module` cannot run under this strategy (called before any process
        starts; e.g. heads that tensor parallelism cannot split)."""

    def check_batch(self, batch_size: int, seq_len: int | None) -> None:
        """Raise a one-line error if a per-rank batch of this shape cannot be split as the strategy
        needs (a recipe calls it before any process starts; a strategy may check every batch too)."""

    def setup_environment(self) -> None:
        """Join or create the process group and pick this process's device."""

    @property
    def root_device(self) -> torch.device:
        """This process's device: the CPU, or the GPU picked from `accelerator`/`devices` (`cuda:LOCAL_RANK`)."""
        return self._device

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def local_rank(self) -> int:
        """This process's index on its node (its GPU under `devices=N`)."""
        return 0

    def planned_group_size(self, name: str) -> int:
        """The size the named group will have, known before any process starts (from the configured
        degrees): what a recipe divides its global batch by."""
        check_group_name(name)
        return 1

    @property
    def dp_rank(self) -> int:
        """This process's index in the batch group (ranks that read different data): its data shard."""
        return self.group_rank("batch")

    @property
    def dp_size(self) -> int:
        """Ranks that read different data: the global batch is dp_size x the per-rank batch."""
        return self.group_size("batch")

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """Where `configure_model` builds layers (a distributed strategy may choose `meta`)."""
        return torch.device(self.root_device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move, cast and wrap (or shard) the module in place; returns it."""
        module = self.precision.convert_module(module.to(self.root_device))
        self.prepare_blocks(module)
        return module

    def prepare_blocks(self, module: nn.Module) -> list[nn.Module]:
        """Activation checkpointing, then compile, applied to each of the model's transformer blocks
        (TorchTitan's order: tensor parallelism before, FSDP after); returns the blocks as they now sit in
        the model, the units a sharded strategy shards. A model without blocks is compiled whole.
        Also records the model's `expert_modules()`, which `after_optimizer_step` balances (every
        strategy's set-up passes here once, with the module as it trains)."""
        self._expert_modules = expert_modules(module)
        blocks = transformer_blocks(module)
        if self.activation_checkpointing:
            if not blocks:
                raise ValueError(
                    f"activation_checkpointing={self.activation_checkpointing!r} recomputes the model's "
                    f"transformer_blocks(); {type(module).__name__} declares none: add the hook, or leave it None"
                )
            blocks = checkpoint_blocks(module, blocks, self.activation_checkpointing)
        if self.compile:
            if not blocks and type(module).forward is nn.Module.forward:
                raise ValueError(
                    f"compile={self.compile!r} compiles the model's transformer_blocks() or its forward(); "
                    f"{type(module).__name__} has neither: add one, or leave compile off"
                )
            compile_units(blocks or [module], self.compile)
        return blocks

    def startup_report(self, module: nn.Module) -> str | None:
        """A line for the start of a run (e.g. per-rank memory of a sharded strategy), or None."""
        return None

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def batch_to_device(self, batch: Any) -> Any:
        """The batch a step runs on: `to_device`'s (a strategy may shard it further: context parallel)."""
        return self.to_device(batch)

    def to_device(self, batch: Any) -> Any:
        """Every tensor of the batch on this process's device, in the precision's input dtype (again: a
        no-op)."""
        device = self.root_device
        if device.type != "cpu":  # loaders yield CPU tensors: nothing to move for a CPU run
            batch = apply_to_tensors(batch, lambda t: t.to(device, non_blocking=True))
        precision = self.precision
        return precision.convert_input(batch) if precision.converts_input else batch

    # ---- one optimizer step ----------------------------------------------------------------------
    def process_dataloader(self, loader: Iterable, seed: int, train: bool = True) -> Iterable:
        """The loader this rank reads: the user's loader split over the batch group (ranks that read
        different data). A strategy that samples differently (DP-SGD's Poisson sampling) overrides this."""
        return shard_loader(loader, self.dp_rank, self.dp_size, seed)

    def train_step(
        self, module: nn.Module, micro_batches: list[Any], first_batch_idx: int
    ) -> StepOutput | None:
        """Forward and backward of every micro-batch of one optimizer step; returns the step's loss and
        token count. The Trainer then normalises, clips and steps. This default is gradient accumulation:
        one forward+backward per micro-batch, gradient sync only on the last. A pipeline schedule or
        DP-SGD overrides it and consumes all micro-batches at once. None: a `training_step` returned
        None (on any rank), so the step is skipped everywhere, as Lightning skips it.

        The ranks agree on skipping without a collective per micro-batch: no rank may take a backward that
        communicates while another skips it, nor step while another skips, so they agree before the last
        micro-batch's backward and, unless the strategy `accumulates_locally`, before every backward; and
        only for a module whose step can return None (strategies/step_skip.py). So: never for a step that
        always returns a loss; once per optimizer step under DDP; per micro-batch under FSDP
        (a backward may all-gather). A rank whose step returned None earlier in the window keeps running
        the forwards (they may communicate too) and leaves out its local backwards. A module whose step
        returns None where its code shows no `return None` gets a one-line error on that rank."""
        agree = self.world_size > 1 and may_return_none(module)
        outputs: list[StepOutput] = []
        skipped = False  # this rank's step returned None in this window (agreed, where `agree`)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            batch = self.batch_to_device(batch)
            with self.accumulation_context(is_last_micro_batch=last):
                output = self.forward_step(module, batch, first_batch_idx + i)
                skipped |= output is None
                if agree and (last or not self.accumulates_locally()):
                    skipped = self.any_rank(skipped)
                    if skipped:
                        return None  # every rank knows now: the rest of the window is not needed
                elif output is None and self.world_size == 1:
                    return None
                elif output is None and not agree:
                    raise ValueError(
                        f"{type(module).__name__}.training_step returned None on rank {self.global_rank}, but "
                        "its code shows no `return None`, so the ranks did not agree to skip the step; allowed: "
                        f"`return None` in training_step itself, or `{DECLARATION} = True` on the module"
                    )
                if skipped:
                    continue  # a backward without collectives: this rank alone may leave it out
                outputs.append(self.backward_output(module, output, 1.0 / len(micro_batches)))
        if skipped:
            return None
        return outputs[0] if len(outputs) == 1 else combine_micro_batches(outputs)

    def watch_local_gradients(self, record: Callable[[torch.Tensor], None]) -> str:
        """Where this rank's gradient can be read before it is combined with other ranks' (for a gradient
        noise estimate, at no extra pass): "micro-batches" here, one process whose `.grad` holds the first
        micro-batch's gradient once the second's backward begins (`record` is not called). A data-parallel
        strategy may instead call `record(squared norm)` per gradient bucket before its all-reduce and
        return "sync". A one-line ValueError where no such gradient exists. Call before `setup_module`."""
        if self.world_size > 1:
            raise ValueError(
                f"{type(self).__name__} has no gradient of one rank before its sync to read; allowed: one "
                "process with accumulation, or DDPStrategy"
            )
        return "micro-batches"

    def accumulation_context(self, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """Wraps each micro-batch; data-parallel strategies skip gradient sync until the last one."""
        return NO_CONTEXT

    def accumulates_locally(self) -> bool:
        """Whether the backwards of a step's micro-batches before the last run no collectives (gradients
        accumulate on each rank), so that a rank may leave one out (see `train_step`). By default not
        assumed; data parallelism by replicas syncs only in the last micro-batch's backward."""
        return False

    def backward_output(self, module: nn.Module, output: Any, loss_scale: float) -> StepOutput:
        """Backward of what `training_step` returned. A loss with "num_tokens" is back-propagated as a
        token *sum* (normalised later by `finish_gradients`); otherwise it is scaled by `loss_scale`."""
        loss, num_tokens = unpack_loss(output, "training_step")
        self.backward_step(module, loss, num_tokens if num_tokens is not None else loss_scale)
        return StepOutput(loss.detach(), num_tokens)

    def forward_step(self, module: nn.Module, batch: Any, batch_idx: int) -> Any:
        """`training_step` under the run's precision, through the wrapper, timed as the forward."""
        with self.clock.phase("forward"), self.precision.autocast():
            return self.call_step(module, "training_step", batch, batch_idx)

    def backward_step(self, module: nn.Module, loss: torch.Tensor, weight: Any) -> None:
        """The fit's `before_backward(loss)` hooks, then the backward of `loss` x `weight`, timed (before a
        fresh run's first, fp16's scaler starts where a token sum's gradients fit: `Precision.settle_scale`)."""
        if not self.precision.settled:
            self.precision.settle_scale(weight, lambda count: self.reduce(count, "max", group="world"))
        if self.before_backward is not None:
            self.before_backward(loss)
        with self.clock.phase("backward"):
            self.backward(loss if isinstance(weight, float) and weight == 1.0 else loss * weight)

    def call_step(self, module: nn.Module, method: str, *args: Any) -> Any:
        """`module.<method>(*args)` so that the wrapper's hooks run around it (DDP's gradient-sync
        bookkeeping, FSDP's parameter gathering) while `self(x)` inside the step still reaches the
        module's own forward. One process, no wrapper: a plain call."""
        return getattr(module, method)(*args)

    def manual_training_step(self, module: nn.Module, batch: Any, batch_idx: int) -> Any:
        """`training_step` of a manually optimized module, which takes its backwards (`manual_backward`) and
        optimizer steps itself, under the run's precision; by default through the wrapper, as `call_step`."""
        with self.precision.autocast():
            return self.call_step(module, "training_step", batch, batch_idx)

    def eval_step(
        self, module: nn.Module, method: str, batch: Any, batch_idx: int, *dataloader_idx: int
    ) -> Any:
        """`validation_step` or `test_step` under the run's precision (the caller disables grad), through
        the wrapper like training steps, so a sharded model gathers its parameters; `dataloader_idx` is given
        (as Lightning gives it) only when the loop has several loaders."""
        with self.precision.autocast():
            return self.call_step(module, method, batch, batch_idx, *dataloader_idx)

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The backward of `loss` taken inside a manually optimized `training_step` (Lightning's
        `manual_backward`; `args`/`kwargs` go to `Tensor.backward`), under the precision's loss scaling. A
        data-parallel strategy first arms its gradient sync: the step runs inside its wrapper's forward."""
        self.precision.backward(loss, *args, **kwargs)

    def finish_gradients(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, num_tokens: torch.Tensor | None
    ) -> None:
        """Make `.grad` the true gradient of the step's mean loss: unscale fp16 gradients and, for
        token-weighted losses, divide the summed gradients by the global token count."""
        self.precision.unscale_gradients(optimizer)
        if num_tokens is not None:
            # gradient sync averages over the ranks of the loss group (they hold different tokens), so
            # each rank's token sum is worth group size / the group's token count
            factor = self.group_size("loss") / self.reduce(num_tokens, "sum", group="loss")
            scale_(_grads(self.trained_parameters(optimizer)), factor)

    def trained_parameters(self, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
        """The parameters `optimizer` updates, whose gradients a step scales, clips and measures (Lightning
        clips the optimizer's too): read from its groups, not by walking the module (most of a small step's
        cost; thousands of modules in a large model), and groups added during the fit count at once."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """Global L2 norm of `params`' gradients (over every shard, stage and rank)."""
        return self.global_norm(_grads(params))

    def global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of this rank's `grads` combined over ranks; sharded strategies override this."""
        return (
            torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=self.root_device)
        )

    def clip_gradients(
        self, params: list[nn.Parameter], max_value: float, algorithm: str, norm: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Clip `params`' gradients by their global norm ("norm") or elementwise ("value"); returns the norm
        before clipping (`norm`, when the step already measured it)."""
        grads = _grads(params)
        norm = self.global_norm(grads) if norm is None else norm
        if algorithm == "norm":  # torch's clip_grads_with_norm_, for gradients on several meshes
            scale_(grads, (max_value / (norm + 1e-6)).clamp(max=1.0))
        else:  # elementwise, so each rank clamps the values it holds (torch's clip_grad_value_ fails on a
            # DTensor whose shard on this rank is empty: a small FSDP-sharded bias)
            for grad in grads:
                local_part(grad).clamp_(-max_value, max_value)
        return norm

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step; False if it was skipped (fp16 overflow)."""
        return self.precision.optimizer_step(optimizer)

    def after_optimizer_step(self) -> None:
        """Per-step bookkeeping of a strategy (privacy accountant), after the optimizer and scheduler
        stepped: here the MoE layers' auxiliary-loss-free bias update, from the loads of the step's
        forwards summed over the ranks that routed other tokens (data, context and tensor parallel)."""
        if self._expert_modules:  # (a model without MoE layers: nothing to do each step)
            update_expert_biases(
                self._expert_modules,
                lambda loads: self.reduce(self.reduce(loads, "sum", group="loss"), "sum", group="tp"),
            )

    def step_metrics(self) -> dict[str, float]:
        """Metrics of the strategy's own, logged with each logged step (DP-SGD: epsilon spent)."""
        return {}

    def stop_reason(self) -> str | None:
        """Why the fit must end now, for good (DP-SGD: the privacy budget is spent), or None; the same on
        every rank. The Trainer then saves a checkpoint and stops."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own state, saved in checkpoints (DP-SGD: the privacy accountant)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (an empty dict from a checkpoint without it)."""

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank (every rank must call it: one all-reduce of a byte when
        there is more than one process), so that all ranks take the same branch."""
        if self.world_size == 1:
            return flag
        return bool(self.reduce(torch.tensor(float(flag), device=self.root_device), "max", group="world"))

    def every_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on every rank (every rank must call it), so that all take the same branch."""
        return not self.any_rank(not flag)

    # ---- collectives (trivial in one process) ----------------------------------------------------
    # Each names its group (strategies/parallel_dims.py: "world", "batch", "loss", "tp", ...), so that
    # nothing reduces over the whole world by accident; one process checks the name all the same.
    def group_rank(self, name: str) -> int:
        """This rank's index within its group `name`."""
        check_group_name(name)
        return 0

    def group_size(self, name: str) -> int:
        """How many ranks this rank's group `name` holds."""
        check_group_name(name)
        return 1

    def reduce(self, tensor: torch.Tensor, op: str = "mean", *, group: str) -> torch.Tensor:
        """All-reduce over the ranks of `group`: "mean", "sum", "max" or "min"."""
        check_reduce_op(op)
        check_group_name(group)
        return tensor

    def all_gather_object(self, obj: Any, *, group: str = "world") -> list[Any]:
        """Every rank's `obj`, indexed by its rank within `group`."""
        check_group_name(group)
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0, *, group: str = "world") -> Any:
        """Global rank `src`'s `obj`, on every rank of its `group`."""
        check_group_name(group)
        return obj

    def barrier(self, *, group: str = "world") -> None:
        """Wait for every rank of `group`."""
        check_group_name(group)

    # ---- checkpoints: the layout this strategy writes, and those it reads (strategies/checkpoint_io/) --
    def save_checkpoint(
        self, path: Path, module: nn.Module, optimizer: Optimizers | None, state: dict[str, Any]
    ) -> None:
        """Write model, optimizer and `state` as one atomic checkpoint directory in this strategy's
        layout (one process: whole files; several: each rank its own part)."""
        self.checkpoint_io.save(path, module, optimizer, state)

    # ---- waits on checkpoint I/O: sized to the work, not to a fixed timeout ------------------------
    def begin_io(self, nbytes: int) -> None:
        """Call on every rank before checkpoint I/O of `nbytes` on this rank: the waits that follow
        (`io_barrier`, `io_gather`, DCP's own) may last as long as the slowest rank's I/O needs."""

    def io_barrier(self) -> None:
        """Wait until every rank finished its checkpoint I/O."""

    def io_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` after its checkpoint I/O, by global rank."""
        return [obj]

    @property
    def io_group(self) -> Any:
        """The process group of the waits on checkpoint I/O (None in one process)."""
        return None

    @property
    def io_part(self) -> tuple[int, int]:
        """(this rank, of how many): its share of verifying a checkpoint's hashes."""
        return self.global_rank, self.world_size

    def agree(self, problem: str | None) -> str | None:
        """The first rank's problem with a checkpoint (each verified its share), on every rank."""
        return next((p for p in self.io_gather(problem) if p is not None), None)

    def reshard(self, module: nn.Module) -> None:
        """Drop parameter copies gathered for a forward, so the next forward reads the parameters as they
        are now (call after changing them in place outside the optimizer). Only sharded strategies gather."""

    @property
    def checkpoint_in_progress(self) -> bool:
        """True while a checkpoint is still being written in the background (async save)."""
        return self.checkpoint_io.in_progress

    def finish_checkpoint(self) -> None:
        """Block until a checkpoint written in the background is complete (call on every rank)."""
        self.checkpoint_io.finish()

    def checkpoint_readers(self) -> dict[str, Callable[..., dict[str, Any]]]:
        """The layouts this strategy loads, each with its loader (the layout it writes first): whole
        files, and sharded state dicts at any world size."""
        readers = {"files": WholeFiles().load, "state_dict": ShardedState(self).load}
        return dict(sorted(readers.items(), key=lambda item: item[0] != self.checkpoint_io.layout))

    def load_checkpoint(self, path: Path, module: nn.Module, optimizer: Optimizers | None) -> dict[str, Any]:
        """Load model (and optimizer) in place from `path`; returns the rest of the saved state. A
        one-line error names a layout this strategy cannot read and those it can."""
        return read_checkpoint(Path(path), module, optimizer, self.checkpoint_readers(), type(self).__name__)

    def teardown(self) -> None:
        """Release processes groups and devices."""
