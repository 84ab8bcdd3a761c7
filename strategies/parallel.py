"""ParallelStrategy: the one strategy of data x tensor x pipeline x context (x expert) parallelism. Its
ParallelDims say which techniques apply, its ParallelOptions how; strategies/parallelize.py applies them
in order. DDPStrategy, FSDPStrategy and Parallel3DStrategy are named presets of it (a constructor each)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from strategies.checkpoint_io.zero1_slices import Zero1Slices
from strategies.gradients import shard_group, sharded_norm
from strategies.memory_report import MemoryReport, measure
from strategies.mesh import MeshStrategy
from strategies.meta_init import materialize
from strategies.parallel_dims import ParallelDims
from strategies.parallelize import Parallelized, ParallelOptions, parallelize
from strategies.step_output import StepOutput, combine_micro_batches
from strategies.techniques.cp.attention import check_sequence
from strategies.techniques.ddp.apply import prepare_for_backward
from strategies.techniques.ep.experts import moe_config
from strategies.techniques.fsdp.apply import init_root
from strategies.techniques.pp.stages import V_SHAPED, check_layers_per_stage
from strategies.techniques.zero1.sliced_parameters import SlicedParameters
from trainer.core.dtensors import full_value, is_dtensor
from trainer.core.rng import reset_seed
from trainer.core.tree import apply_to_tensors

if TYPE_CHECKING:
    from strategies.techniques.pp.schedule import Pipeline

# the methods the Trainer calls on the module: each runs FSDP's root pre/post-forward like `forward`
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
# the module hooks each degree needs, when it is above 1
HOOKS = {
    "tp": ("tensor_parallel_plan",),
    "cp": ("enable_context_parallel",),
    "pp": ("pipeline_model", "pipeline_batch", "pipeline_loss"),
}


class ParallelStrategy(MeshStrategy):
    """Parallelism of `dims` (None: every rank a replica, plain data parallel) run as `options` say.
    With `async_save` (sharded layouts) a checkpoint is written in the background while training
    continues (the next save waits for it)."""

    name = "parallel"

    def __init__(
        self,
        dims: ParallelDims | None,
        options: ParallelOptions,
        *,
        activation_checkpointing: str | None = None,
        async_save: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(timeout_s=timeout_s)
        self.dims, self.options = dims, options
        self.activation_checkpointing, self.async_save = activation_checkpointing, async_save
        self.zero_stage = options.zero_stage
        self.n_stages = options.n_stages(self.pp)
        # phases in which a rank waits for no other: ZeRO-1 all-gathers parameters after the step, FSDP
        # all-gathers them in the forward, DDP only all-reduces in the backward
        self.local_phases = {
            "ddp": ("data", "forward", "optimizer"),
            "zero1": ("data", "forward"),
            "fsdp": ("data", "optimizer"),
        }[options.data_parallel]
        self.model: nn.Module | None = None  # the DDP wrapper ("ddp"/"zero1"): steps run through it
        self.pipeline: Pipeline | None = None
        self.context: Any = None  # cp > 1: the ContextParallel that shards each batch
        self._sliced: SlicedParameters | None = None  # "zero1": the optimizer's slices
        self._parts: Parallelized | None = None
        self._root: nn.Module | None = None  # "fsdp": the fully_shard-ed module
        self._step_methods: list[str] = []  # registered as FSDP forward methods on it
        # a GradientNoiseScale's record of each bucket's squared norm before DDP's all-reduce, or None
        self._watch: Callable[[torch.Tensor], None] | None = None
        if options.data_parallel == "zero1":
            self.checkpoint_io = Zero1Slices(self, lambda: self._sliced)

    def setup_environment(self) -> None:
        super().setup_environment()
        # as Lightning's parallel strategies (setup_distributed): every process seeded again with
        # seed_everything's seed, so a launch's ranks draw alike whatever they drew before the stage
        reset_seed()

    # ---- the degrees -------------------------------------------------------------------------------
    def parallel_dims(self) -> ParallelDims:
        return super().parallel_dims() if self.dims is None else self.dims

    def _degree(self, name: str) -> int:
        return 1 if self.dims is None else getattr(self.dims, name)

    @property
    def tp(self) -> int:
        return self._degree("tp")

    @property
    def pp(self) -> int:
        return self._degree("pp")

    @property
    def cp(self) -> int:
        return self._degree("cp")

    @property
    def ep(self) -> int:
        return self._degree("ep")

    @property
    def replicate(self) -> int:
        return self._degree("dp_replicate")

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.parallel_dims()})" if self.dims else type(self).__name__

    @property
    def _sharded(self) -> bool:
        return self.options.data_parallel == "fsdp"

    # ---- checks before any process starts ----------------------------------------------------------
    def check_configuration(self) -> None:
        world, precision, options = self.devices * self.num_nodes, self.precision, self.options
        if world % self.replicate:
            raise ValueError(
                f"replicate={self.replicate} does not divide the world of {world} processes; allowed: a divisor of {world}"
            )
        if self._sharded and precision.name == "16-mixed":
            raise ValueError(
                "precision '16-mixed' needs a gradient scaler FSDP2 lacks; allowed with fsdp: '32', 'bf16-mixed', 'bf16-true'"
            )
        if self._sharded and precision.name == "bf16-mixed":
            precision.autocast_forward = False  # FSDP2 casts the gathered parameters itself
        if options.gradient_compression == "bf16" and self.accelerator != "cuda":
            raise ValueError(
                "gradient_compression='bf16' needs CUDA with NCCL (DDP's bf16 hook); allowed on the CPU: 'fp16', 'powersgd'"
            )
        super().check_configuration()
        dims = self.parallel_dims().resolve(world)
        data_parallel = dims.dp_replicate * dims.dp_shard * dims.cp
        zero_bubble = options.zero_bubble(self.pp)
        if zero_bubble and data_parallel > 1:
            raise ValueError(
                f"pp_schedule={options.pp_schedule!r} with data parallelism (dp_replicate*dp_shard*cp = {data_parallel}) "
                "loses the deferred weight gradients of FSDP-sharded stages (torch.distributed.pipelining, "
                "measured on torch 2.13); allowed with data parallelism: GPipe, 1F1B, Interleaved1F1B, LoopedBFS"
            )
        if zero_bubble:
            precision.autocast_forward = True  # no FSDP to cast the parameters: autocast does
        model_parallel = {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}
        if self.compile and max(model_parallel.values()) > 1:
            raise ValueError(
                f"compile={self.compile!r} with {', '.join(f'{k}={v}' for k, v in model_parallel.items() if v > 1)}: "
                "compiled blocks are validated against eager ones under data parallelism only (with tp=2 the "
                "losses differed by 4e-3 in fp32, torch 2.13); allowed: compile=False, or tp=pp=cp=ep=1"
            )

    def check_module(self, module: nn.Module) -> None:
        """One-line errors for a model these degrees cannot cut: heads not divisible by tp, fewer
        blocks than pipeline stages, a hook the degrees need and the module lacks; manual optimization where
        the layout owns part of the step."""
        if not getattr(module, "automatic_optimization", True):
            self._check_manual_optimization(type(module).__name__)
        for degree, hooks in HOOKS.items():
            for hook in hooks if self._degree(degree) > 1 else ():
                if not callable(getattr(module, hook, None)):
                    raise ValueError(
                        f"{type(module).__name__} does not declare {hook}(), which {self} needs; "
                        "allowed: a module that declares it (see trainer.models.causal_lm.CausalLM)"
                    )
        if self.ep > 1:
            self._check_experts(module)
        if self.tp > 1 and self.pp > 1 and moe_config(module) is not None:
            raise ValueError(
                f"tp={self.tp} with pp={self.pp} on a MoE model: MoE layers run tensor parallel or pipelined, not "
                "both at once; allowed: tp=1 or pp=1 with a MoE model"
            )
        shape = getattr(module, "parallel_shape", None)
        shape = shape() if callable(shape) else None
        if shape is not None:
            self._check_shape(shape)

    def _check_manual_optimization(self, name: str) -> None:
        """A manually optimized module (whose step does its own backwards and optimizer steps) runs under DDP
        and FSDP stages 2/3; the layouts that own part of the step themselves are refused in one line."""
        if self.pp > 1:
            raise ValueError(
                f"{name} optimizes manually, but pp={self.pp} runs each step's forward and backward in the "
                "pipeline schedule; allowed with manual optimization: pp=1"
            )
        if self.options.data_parallel == "zero1":
            raise ValueError(
                f"{name} optimizes manually, but zero_stage=1 slices the state of the one optimizer the Trainer "
                "steps; allowed with manual optimization: DDP, or FSDP with zero_stage 2 or 3"
            )
        model_parallel = {"tp": self.tp, "cp": self.cp, "ep": self.ep}
        if max(model_parallel.values()) > 1:
            degrees = ", ".join(f"{k}={v}" for k, v in model_parallel.items() if v > 1)
            raise ValueError(
                f"{name} optimizes manually, with {degrees}: manual optimization is validated under data "
                "parallelism only; allowed with manual optimization: tp=cp=ep=1"
            )

    def _check_shape(self, shape: dict[str, Any]) -> None:
        for what in ("heads", "kv_heads", "vocab"):
            if shape[what] % self.tp:
                raise ValueError(
                    f"tp={self.tp} does not divide the model's {shape[what]} {what.replace('_', '-')}; "
                    f"allowed: a tp that divides {shape[what]} (or a model whose {what} tp divides)"
                )
        if self.pp > 1 and shape["tied"]:
            raise ValueError(
                f"pp={self.pp} puts the embedding and the output on different stages, but the model ties them "
                "(tie_embeddings=True); allowed: pp=1, or an untied model"
            )
        if self.n_stages > shape["blocks"]:
            raise ValueError(
                f"pp={self.pp} with {self.options.pp_schedule} makes {self.n_stages} stages but the model has "
                f"{shape['blocks']} blocks; allowed: at most {shape['blocks']} stages"
            )
        if self.options.pp_layers_per_stage is not None:
            check_layers_per_stage(self.options.pp_layers_per_stage, self.n_stages, shape["blocks"])

    def _check_experts(self, module: nn.Module) -> None:
        """One-line errors for ep > 1 on a model without MoE layers, or whose experts ep does not divide."""
        moe = moe_config(module)
        if moe is None:
            raise ValueError(
                f"ep={self.ep} needs a MoE model (LlamaConfig.moe), but {type(module).__name__} has none; "
                "allowed: ep=1, or a MoE model"
            )
        if moe.n_experts % self.ep:
            raise ValueError(
                f"ep={self.ep}: the model's E={moe.n_experts} experts are not divisible by ep; allowed: an ep "
                f"that divides {moe.n_experts}"
            )

    def check_batch(self, batch_size: int, seq_len: int | None) -> None:
        """One-line errors for a per-rank batch the micro-batches do not divide, or a sequence that
        does not split over cp's load-balanced chunks and tp's sequence shards."""
        microbatches = self.options.microbatches
        if self.pp > 1 and batch_size % microbatches:
            raise ValueError(
                f"the per-rank batch of {batch_size} does not split into microbatches={microbatches}; "
                f"allowed: a batch size that is a multiple of {microbatches}"
            )
        if seq_len is not None:
            check_sequence(seq_len, self.cp, self.tp if self.options.sequence_parallel else 1)

    # ---- set-up ------------------------------------------------------------------------------------
    def module_init_context(self) -> contextlib.AbstractContextManager:
        """`configure_model` builds on meta when sharded: nothing is allocated until each rank holds only
        its shards."""
        return torch.device("meta") if self._sharded else super().module_init_context()

    def shard(self, module: nn.Module) -> nn.Module:
        """Apply every technique (strategies/parallelize.py) to `module` in place; returns it."""
        self._parts = parallelize(
            module,
            self.mesh,
            self.options,
            self.precision,
            self.root_device,
            self.prepare_blocks,
            self._watch,
        )
        self.model, self.context = self._parts.ddp, self._parts.context
        return self._parts.module

    def setup_module(self, module: nn.Module) -> nn.Module:
        if self._sharded and self._parts is not None and self._parts.module is module:
            # sharded by this strategy's earlier fit (test after fit): FSDP cannot shard a module twice, and
            # its shards are the trained weights; only the step methods are registered again
            self.context = self._parts.context
        else:
            module = self.shard(module)
        if not self._sharded:
            return module  # replicas: the optimizer state of "zero1" is sliced in setup_optimizer
        if any(p.is_meta for p in module.parameters()):
            materialize(module, self.root_device)
        # A step reads root parameters outside `forward` (`self.net(x)`, a tied head): registered, each
        # step gathers them as `forward` would; `self(x)` inside it is a nested forward FSDP2 tolerates.
        self._root = module
        from torch.distributed.fsdp import register_fsdp_forward_method  # not at import: see dtensors.py

        self._step_methods = [m for m in STEP_METHODS if hasattr(module, m)]
        for method in self._step_methods:
            register_fsdp_forward_method(module, method)
        if self.pp > 1:  # built from the stages as FSDP left them
            from strategies.techniques.pp.schedule import Pipeline  # imports torch._dynamo: only when used

            options = self.options
            self.pipeline = Pipeline(
                self._parts.views,
                self._parts.stage_ids,
                self.n_stages,
                options.pp_schedule,
                options.microbatches,
                self.mesh.group("pp"),
                self.root_device,
                module.pipeline_loss,
            )
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.options.data_parallel != "zero1":
            return optimizer
        self._sliced = SlicedParameters(optimizer, self.dp_rank, self.dp_size, self.dp_group)
        return self._sliced.optimizer

    def trained_parameters(self, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
        """ZeRO-1's optimizer steps slices: the whole parameters it was built on hold the step's gradients."""
        return super().trained_parameters(optimizer) if self._sliced is None else self._sliced.whole()

    def startup_report(self, module: nn.Module) -> str | None:
        return self.memory_report(module, None).lines() if self.zero_stage else None

    def memory_report(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> MemoryReport:
        """This rank's bytes in parameters, gradients and optimizer states, and the formula's; the ranks
        sharing a stage's parameters are FSDP's x tp's."""
        return measure(module, optimizer, self.zero_stage, self.group_size("dense") * self.tp)

    # ---- the step ----------------------------------------------------------------------------------
    def process_dataloader(self, loader: Any, seed: int, train: bool = True) -> Any:
        if not train and self.pp > 1 and self.options.pp_schedule in V_SHAPED:
            raise ValueError(
                f"validation/test under pp_schedule={self.options.pp_schedule!r}: torch.distributed.pipelining "
                "cannot run this schedule forward-only (measured on torch 2.13); allowed: InterleavedZeroBubble, "
                "another schedule, or no validation loader"
            )
        return super().process_dataloader(loader, seed, train)

    def batch_to_device(self, batch: Any) -> Any:
        batch = super().batch_to_device(batch)
        if max(self.pp, self.cp, self.tp) == 1:
            return batch
        shaped: list[torch.Tensor] = []
        apply_to_tensors(batch, lambda t: shaped.append(t) if t.dim() >= 2 else None)
        if shaped:  # (batch, sequence, ...): what micro-batches and sequence shards must divide
            self.check_batch(shaped[0].shape[0], shaped[0].shape[1])
        if self.context is None:
            return batch
        # every tensor with a sequence dimension (dim 1) is split into this rank's load-balanced chunks
        return apply_to_tensors(batch, lambda t: self.context.shard(t, 1) if t.dim() >= 2 else t)

    def _loss_parallel(self) -> contextlib.AbstractContextManager:
        """Cross-entropy over vocabulary-sharded logits; must enclose the loss's forward and backward."""
        if self.tp > 1 and self.options.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def call_step(self, module: nn.Module, method: str, *args: Any) -> Any:
        with self._loss_parallel():
            if self.model is not None:
                return self.model(method, *args)  # through DDP, which syncs the step's backward
            return getattr(module, method)(*args)  # registered: runs inside FSDP's pre/post-forward

    def manual_training_step(self, module: nn.Module, batch: Any, batch_idx: int) -> Any:
        if not self._sharded:  # through DDP: manual_backward arms its sync for each backward
            return super().manual_training_step(module, batch, batch_idx)
        # Not as FSDP's registered forward method: the root's gradients reduce-scatter in a backward after it
        # returns, not in one taken inside it (they would stay unsynced, silently). Called plainly, each layer
        # the step runs (`self(x)`, a unit of `transformer_blocks()`) gathers its parameters in its own forward
        # and reduce-scatters them in its own backward; a root's layer called outside `self(x)` meets its shards.
        init_root(self._root)
        try:
            with self.precision.autocast(), self._loss_parallel():
                return type(module).training_step(module, batch, batch_idx)
        except RuntimeError as err:
            if "mixed torch.Tensor and DTensor" not in str(err):
                raise
            raise RuntimeError(
                f"{type(module).__name__}.training_step ran a layer outside `self(x)` and outside the units of "
                "transformer_blocks(), whose parameters FSDP holds sharded in a manually optimized step; "
                "allowed: call it through forward, or declare it in transformer_blocks()"
            ) from None

    def watch_local_gradients(self, record: Callable[[torch.Tensor], None]) -> str:
        """Replicas (DDP, ZeRO-1): "sync", `record` getting each gradient bucket's squared norm before DDP
        all-reduces it (techniques/ddp/apply.py). Refused where no rank holds its whole gradient."""
        degrees = {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}
        split = ", ".join(f"{k}={v}" for k, v in degrees.items() if v > 1)
        if self._sharded or split:
            why = "reduce-scatters each block's gradient in the backward, as soon as it is made"
            raise ValueError(
                f"{type(self).__name__} {why if self._sharded else f'with {split} splits the gradient over ranks'}, "
                "so no rank holds its whole gradient before the sync; allowed: DDPStrategy (or ZeRO-1), tp=pp=cp=ep=1"
            )
        if self.dp_size == 1:
            return super().watch_local_gradients(record)
        self._watch = record
        return "sync"

    def accumulation_context(self, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """Gradient sync only on the step's last micro-batch; the others accumulate locally."""
        if self.model is not None:
            return contextlib.nullcontext() if is_last_micro_batch else self.model.no_sync()
        self._root.set_requires_gradient_sync(is_last_micro_batch)  # reduce-scatter once per step
        return contextlib.nullcontext()

    def accumulates_locally(self) -> bool:
        # DDP/ZeRO-1 under no_sync run no collective before the last backward; FSDP's backward may
        # all-gather (stage 3) and tp/cp/ep/pp exchange gradients of activations in every backward
        return not self._sharded and max(self.tp, self.cp, self.ep, self.pp) == 1

    def backward(self, loss: torch.Tensor) -> None:
        with self._loss_parallel():
            super().backward(loss)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.model is not None:  # the step runs inside DDP's forward: its sync is armed after it, too late
            prepare_for_backward(self.model, loss)
        with self._loss_parallel():
            super().manual_backward(loss, *args, **kwargs)

    def train_step(self, module: nn.Module, micro_batches: list[Any], first_batch_idx: int) -> StepOutput:
        if self.pipeline is None:
            return super().train_step(module, micro_batches, first_batch_idx)
        outputs = []
        for batch in micro_batches:
            batch = self.batch_to_device(batch)
            inputs, target = module.pipeline_batch(batch)
            with self.clock.phase("forward"), self._loss_parallel():  # the schedule interleaves fwd/bwd
                outputs.append(self.pipeline.step(inputs, target, 1.0 / len(micro_batches)))
        return combine_micro_batches(outputs)

    def eval_step(self, module: nn.Module, method: str, batch: Any, batch_idx: int, *loader_idx: int) -> Any:
        if self.pipeline is None:
            return super().eval_step(module, method, batch, batch_idx, *loader_idx)
        if method == "predict_step":
            raise ValueError(
                "predict under pp>1: the pipeline runs the model's loss on its last stage, not predict_step; "
                "allowed: predict with a layout without pipeline stages (pp=1)"
            )
        inputs, target = module.pipeline_batch(batch)
        with self._loss_parallel():
            out = self.pipeline.evaluate(inputs, target)
        return {"loss": out.loss, "num_tokens": out.num_tokens} if out.num_tokens is not None else out.loss

    def global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm over every shard, tp rank and stage: per mesh a DTensor norm (reduced over its
        shards), then the squares summed over the pipeline stages, which hold different parameters."""
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for g in grads:
            by_mesh.setdefault(g.device_mesh if is_dtensor(g) else None, []).append(g)
        if len(by_mesh) <= 1 and self.pp == 1:  # one mesh (or none: replicas): one norm
            group = shard_group(grads)  # FSDP2's or HSDP's shards: one all-reduce, no DTensor op dispatch
            return sharded_norm(grads, group) if group is not None else full_value(super().global_norm(grads))
        squares = torch.zeros((), device=self.root_device)
        for group in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(group, 2.0)
            squares = squares + full_value(norm).float() ** 2
        if self.pp > 1:
            dist.all_reduce(squares, group=self.mesh.group("pp"))
        return squares.sqrt()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._sliced is None:
            return super().optimizer_step(optimizer)
        self._sliced.attach_gradients()
        stepped = super().optimizer_step(optimizer)
        self._sliced.gather_parameters()
        return stepped

    # ---- checkpoints: every rank writes its own part (strategies/checkpoint_io/) -------------------
    def checkpoint_readers(self) -> dict[str, Callable[..., dict[str, Any]]]:
        io = self.checkpoint_io
        if isinstance(io, Zero1Slices):  # and whole files: ZeRO-1 wrote them before sharded saves
            return {"zero1": io.load, "files": io.load_whole_files}
        if self._sharded:  # shards cannot be filled from whole files without gathering them first
            return {"state_dict": io.load}
        return super().checkpoint_readers()

    def reshard(self, module: nn.Module) -> None:
        # stage 2 keeps parameters gathered after a forward without backward (an eval step)
        fsdp = sys.modules.get("torch.distributed.fsdp")
        if fsdp is None:
            return  # not imported: nothing in this process was sharded by FSDP2
        for m in module.modules():
            if isinstance(m, fsdp.FSDPModule):
                m.reshard()

    def teardown(self) -> None:
        self.finish_checkpoint()
        for method in self._step_methods:  # drop the instance attributes that registration added
            vars(self._root).pop(method, None)
        # the parts stay: a later validate/test/predict of the same sharded module reuses them
        self._root, self._step_methods, self.pipeline = None, [], None
        # DDP's reducer holds the process group; freed here, not by C++ destructors while Python shuts down
        self.model = None
        super().teardown()
