"""Parallel3DStrategy: tensor (+ sequence, + loss) parallel, pipeline parallel and context parallel,
composed with FSDP/HSDP over the rest of the world, on one mesh (strategies/parallel_dims.py).

The order is TorchTitan's: cut pipeline stages -> tensor parallel -> activation checkpointing ->
FSDP (per stage) -> materialise. A model takes part through declared hooks: `tensor_parallel_plan`,
`pipeline_model`/`pipeline_batch`/`pipeline_loss` (its model: `pipeline_layout`) and
`enable_context_parallel`; each is needed only when its degree is above 1.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from strategies.activation_checkpointing import transformer_blocks
from strategies.base import StepOutput, combine_micro_batches
from strategies.context_parallel import ContextParallel, check_sequence
from strategies.expert_parallel import apply_expert_parallel
from strategies.experts import expert_modules
from strategies.fsdp import FSDPStrategy
from strategies.memory import MemoryReport, measure
from strategies.parallel_dims import ParallelDims
from strategies.pipeline import (
    SCHEDULES,
    V_SHAPED,
    ZERO_BUBBLE,
    Pipeline,
    check_layers_per_stage,
    check_schedule,
    prune,
    split_blocks,
    stage_ids,
    stage_view,
)
from trainer.tree import apply_to_tensors


def _degree(name: str, value: Any, allow_rest: bool = False) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or (value < 1 and not (allow_rest and value == -1))
    ):
        rest = ", or -1 for the rest of the world" if allow_rest else ""
        raise ValueError(f"{name}={value!r} is invalid; allowed: an int >= 1{rest}")
    return value


def _moe_config(module: nn.Module) -> Any:
    """The MoE config of a CausalLM's Llama (its config or its built model's), or None."""
    config = getattr(module, "config", None) or getattr(getattr(module, "model", None), "config", None)
    return getattr(config, "moe", None)


def _expert_placement(param: torch.Tensor, shards: int) -> Shard:
    """FSDP's placement of an expert weight (E/ep local experts, in, out) over `shards` ranks: dim 0, whole
    experts per rank, when the local experts divide; else dim 1 (the model dim or ffn, in practice a multiple
    of `shards`). FSDP pads an uneven dim 0 to ceil(E/ep / shards) experts on every rank (Mixtral's 8 at ep=8
    over an 8-rank "expert" mesh: 8 ranks each store a whole expert, 7 of them zeros) but refuses an uneven
    dim 1, so dim 0 stays where neither divides. Dim 1 costs a copy around each all-gather and reduce-scatter
    (FSDP regroups the ranks' slices): the exception, not the rule. (TorchTitan's rule, ep * shards > E,
    keeps dim 0 for E/ep = 3 over 2 ranks, padded to 4.)"""
    local = param.to_local() if isinstance(param, DTensor) else param
    return Shard(1) if local.shape[0] % shards and local.shape[1] % shards == 0 else Shard(0)


def _not_the_norms_reduction(record: logging.LogRecord) -> bool:
    """DTensor warns (once per rank) that reducing the gradient norm over the 2-D (dense, tp) mesh takes
    two all-reduces of one scalar each; that is what the clipping norm costs, and it is negligible."""
    return "_NormPartial" not in str(record.args)


class Parallel3DStrategy(FSDPStrategy):
    """Data x tensor x pipeline (x context) parallelism.

    - `tp`: DTensor tensor parallelism with the model's plan; `sequence_parallel` shards the activations
      between blocks over the tp ranks, `loss_parallel` keeps the logits vocabulary-sharded for the loss.
    - `pp`: pipeline stages cut at block boundaries (`pp_layers_per_stage` or balanced), run by the
      schedule `pp_schedule` over `microbatches` micro-batches of each batch (default: pp).
    - `cp`: the sequence sharded over cp ranks (load-balanced chunks), attention over gathered K/V.
    - `dp_shard` (FSDP, ZeRO `zero_stage` 2 or 3) and `dp_replicate` (HSDP's replicas; with
      dp_shard=1 plain replication, i.e. DDP) over what is left: dp_shard=-1 takes the rest.
    - `ep`: expert parallelism of MoE layers over ep of the dp_shard x cp x tp ranks: each holds E/ep
      experts (DTensor Shard(0) on the "ep" mesh, FSDP-sharded over the "expert" mesh) and exchanges
      tokens with all-to-alls (strategies/expert_parallel.py). With tp, each tp rank routes its own
      sequence shard (the model's plan) and the ep ranks are the tp ranks first; with pp, each stage's
      MoE layers exchange tokens with the ep ranks of that stage. Not with tp and pp at once.
    """

    name = "parallel3d"

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        pp_schedule: str = "1F1B",
        microbatches: int | None = None,
        pp_layers_per_stage: list[int] | None = None,
        zero_stage: int = 3,
        reduce_dtype: str = "fp32",
        activation_checkpointing: str | None = None,
        async_save: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        if zero_stage not in (2, 3) or isinstance(zero_stage, bool):
            raise ValueError(f"zero_stage={zero_stage!r} is invalid for parallel3d; allowed: 2 or 3")
        super().__init__(
            zero_stage=zero_stage,
            replicate=_degree("dp_replicate", dp_replicate),
            reduce_dtype=reduce_dtype,
            activation_checkpointing=activation_checkpointing,
            async_save=async_save,
            timeout_s=timeout_s,
        )
        self.dp_shard = _degree("dp_shard", dp_shard, allow_rest=True)
        self.tp, self.pp, self.cp = _degree("tp", tp), _degree("pp", pp), _degree("cp", cp)
        self.ep = _degree("ep", ep)
        if self.ep > 1 and self.tp > 1 and self.pp > 1:
            raise ValueError(
                f"ep={ep} with tp={tp} and pp={pp}: expert parallelism is composed with tensor or with pipeline "
                "parallelism, not with both at once; allowed: ep > 1 with tp=1 or pp=1"
            )
        self.sequence_parallel, self.loss_parallel = bool(sequence_parallel), bool(loss_parallel)
        self.pp_schedule = check_schedule(pp_schedule)
        if microbatches is not None:
            _degree("microbatches", microbatches)
        self.microbatches = microbatches if microbatches is not None else pp
        self.n_stages = pp * SCHEDULES[pp_schedule]
        if pp_layers_per_stage is not None:
            check_layers_per_stage(pp_layers_per_stage, self.n_stages, sum(pp_layers_per_stage))
        self.pp_layers_per_stage = pp_layers_per_stage
        self.pipeline: Pipeline | None = None
        self.context: ContextParallel | None = None

    def parallel_dims(self) -> ParallelDims:
        return ParallelDims(
            dp_replicate=self.replicate,
            dp_shard=self.dp_shard,
            cp=self.cp,
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
        )

    # ---- checks before any process starts ----------------------------------------------------------
    def check_module(self, module: nn.Module) -> None:
        """One-line errors for a model these degrees cannot cut: heads not divisible by tp, fewer
        blocks than pipeline stages, a hook the degrees need and the module lacks."""
        needs = {"tensor_parallel_plan": self.tp > 1, "enable_context_parallel": self.cp > 1}
        needs.update(dict.fromkeys(("pipeline_model", "pipeline_batch", "pipeline_loss"), self.pp > 1))
        for hook, needed in needs.items():
            if needed and not callable(getattr(module, hook, None)):
                raise ValueError(
                    f"{type(module).__name__} does not declare {hook}(), which {self} needs; "
                    "allowed: a module that declares it (see trainer.models.causal_lm.CausalLM)"
                )
        if self.ep > 1:
            self._check_experts(module)
        if self.tp > 1 and self.pp > 1 and _moe_config(module) is not None:
            raise ValueError(
                f"tp={self.tp} with pp={self.pp} on a MoE model: MoE layers run tensor parallel or pipelined, not "
                "both at once; allowed: tp=1 or pp=1 with a MoE model"
            )
        shape = getattr(module, "parallel_shape", None)
        shape = shape() if callable(shape) else None
        if shape is None:
            return
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
                f"pp={self.pp} with {self.pp_schedule} makes {self.n_stages} stages but the model has "
                f"{shape['blocks']} blocks; allowed: at most {shape['blocks']} stages"
            )
        if self.pp_layers_per_stage is not None:
            check_layers_per_stage(self.pp_layers_per_stage, self.n_stages, shape["blocks"])

    def _check_experts(self, module: nn.Module) -> None:
        """One-line errors for ep > 1 on a model without MoE layers, or whose experts ep does not divide."""
        moe = _moe_config(module)
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
        if self.pp > 1 and batch_size % self.microbatches:
            raise ValueError(
                f"the per-rank batch of {batch_size} does not split into microbatches={self.microbatches}; "
                f"allowed: a batch size that is a multiple of {self.microbatches}"
            )
        if seq_len is not None:
            check_sequence(seq_len, self.cp, self.tp if self.sequence_parallel else 1)

    def check_configuration(self) -> None:
        super().check_configuration()
        dims = self.parallel_dims().resolve(self.devices * self.num_nodes)
        data_parallel = dims.dp_replicate * dims.dp_shard * dims.cp
        if self._zero_bubble and data_parallel > 1:
            raise ValueError(
                f"pp_schedule={self.pp_schedule!r} with data parallelism (dp_replicate*dp_shard*cp = {data_parallel}) "
                "loses the deferred weight gradients of FSDP-sharded stages (torch.distributed.pipelining, "
                "measured on torch 2.13); allowed with data parallelism: GPipe, 1F1B, Interleaved1F1B, LoopedBFS"
            )
        if self._zero_bubble:
            self.precision.autocast_forward = True  # no FSDP to cast the parameters: autocast does
        model_parallel = {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}
        if self.compile and max(model_parallel.values()) > 1:
            raise ValueError(
                f"compile={self.compile!r} with {', '.join(f'{k}={v}' for k, v in model_parallel.items() if v > 1)}: "
                "compiled blocks are validated against eager ones under data parallelism only (with tp=2 the "
                "losses differed by 4e-3 in fp32, torch 2.13); allowed: compile=False, or tp=pp=cp=ep=1"
            )

    @property
    def _zero_bubble(self) -> bool:
        """A zero-bubble pipeline: its stages run without FSDP (see check_configuration)."""
        return self.pp > 1 and self.pp_schedule in ZERO_BUBBLE

    def __str__(self) -> str:
        return f"Parallel3DStrategy({self.parallel_dims()})"

    # ---- wrapping ----------------------------------------------------------------------------------
    def shard(self, module: nn.Module) -> nn.Module:
        logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_not_the_norms_reduction)
        module = self.precision.convert_module(module)
        if self.cp > 1:
            self.context = ContextParallel(self.mesh.group("cp"), self.mesh.rank("cp"), self.cp)
            context, device = self.context, self.root_device
            module.enable_context_parallel(
                context.attention, lambda: context.positions(context.seq_len, device)
            )
        model, ids, stage_blocks = None, [], []
        if self.pp > 1:
            model = module.pipeline_model()
            names = list(getattr(model, model.pipeline_layout()[1]))
            stage_blocks = split_blocks(names, self.n_stages, self.pp_layers_per_stage)
            ids = stage_ids(self.pp_schedule, self.mesh.rank("pp"), self.pp)
            prune(model, [stage_blocks[i] for i in ids], 0 in ids, self.n_stages - 1 in ids)
        if self.tp > 1:
            plan = module.tensor_parallel_plan(self.sequence_parallel, self.loss_parallel)
            parallelize_module(module, self.mesh.mesh("tp"), plan)
        if self.ep > 1:
            apply_expert_parallel(module, self.mesh.mesh("ep"), self.mesh.group("ep"))
        blocks = self.prepare_blocks(module)
        if model is None:
            self._shard_experts(module)
            self.fully_shard_units(blocks, module)
            return module
        views = [stage_view(model, stage_blocks[i], i == 0, i == self.n_stages - 1) for i in ids]
        for view in views:
            if not self._zero_bubble:
                self._shard_experts(view)
                self.fully_shard_units(transformer_blocks(view), view)
        self._views, self._ids = views, ids
        return module

    def _shard_experts(self, module: nn.Module) -> None:
        """The experts of `module`'s MoE layers as FSDP units of their own over the "expert" mesh (before
        their blocks take the rest, over "dense"), under ep > 1 or tp > 1. An expert's gradient sums the
        tokens of every ep rank, and the "expert" mesh holds the tp ranks that ep does not (their sequence
        shards, routed through replicated experts); so FSDP divides it by the data-parallel degree of the
        dense parameters (dp_replicate*dp_shard*cp), not by the size of the "expert" mesh: both then hold
        the gradient of the global mean loss (TorchTitan does the same). Each weight is sharded on the dim
        `_expert_placement` picks: when the local experts do not split over the "expert" mesh, their inner
        dim. The gradient's divide factor, the norm (DTensor, over every mesh dim) and DCP (each shard's
        global offsets from its placements) do not depend on which dim that is."""
        experts = [layer.experts for layer in expert_modules(module)]  # a stage view: its own layers
        if not experts or (self.ep == 1 and self.tp == 1):
            return
        shards = self.mesh.size("expert")  # FSDP's shard dim; under HSDP the replicas hold copies
        kwargs: dict[str, Any] = {
            "mesh": self.mesh.mesh("expert"),
            "reshard_after_forward": self.zero_stage == 3,
            "shard_placement_fn": lambda param: _expert_placement(param, shards),
        }
        if self.precision.name == "bf16-mixed":
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=self.reduce_dtype
            )
        dims = self.mesh.dims
        factor = float(dims.dp_replicate * dims.dp_shard * dims.cp)
        for unit in experts:
            fully_shard(unit, **kwargs)
            unit.set_gradient_divide_factor(factor)
            # gloo has no PREMUL_SUM: reduce by SUM, then divide. Not on a 1-rank "expert" mesh, where
            # FSDP (torch 2.13) skips the reduce-scatter, divides in its copy and would divide again.
            if self.root_device.type == "cpu" and shards > 1:
                unit.set_force_sum_reduction_for_comms(True)

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        if self.pp > 1:
            self.pipeline = Pipeline(
                self._views,
                self._ids,
                self.n_stages,
                self.pp_schedule,
                self.microbatches,
                self.mesh.group("pp"),
                self.root_device,
                module.pipeline_loss,
            )
        return module

    # ---- the step ----------------------------------------------------------------------------------
    def process_dataloader(self, loader: Any, seed: int, train: bool = True) -> Any:
        if not train and self.pp > 1 and self.pp_schedule in V_SHAPED:
            raise ValueError(
                f"validation/test under pp_schedule={self.pp_schedule!r}: torch.distributed.pipelining cannot run "
                "this schedule forward-only (measured on torch 2.13); allowed: InterleavedZeroBubble, another "
                "schedule, or no validation loader"
            )
        return super().process_dataloader(loader, seed, train)

    def _loss_parallel(self) -> contextlib.AbstractContextManager:
        """Cross-entropy over vocabulary-sharded logits; must enclose the loss's forward and backward."""
        return loss_parallel() if self.tp > 1 and self.loss_parallel else contextlib.nullcontext()

    def batch_to_device(self, batch: Any) -> Any:
        batch = super().batch_to_device(batch)
        shaped: list[torch.Tensor] = []
        apply_to_tensors(batch, lambda t: shaped.append(t) if t.dim() >= 2 else None)
        if shaped:  # (batch, sequence, ...): what micro-batches and sequence shards must divide
            self.check_batch(shaped[0].shape[0], shaped[0].shape[1])
        if self.context is None:
            return batch
        # every tensor with a sequence dimension (dim 1) is split into this rank's load-balanced chunks
        return apply_to_tensors(batch, lambda t: self.context.shard(t, 1) if t.dim() >= 2 else t)

    def call_step(self, module: nn.Module, method: str, *args: Any) -> Any:
        with self._loss_parallel():
            return super().call_step(module, method, *args)

    def backward(self, loss: torch.Tensor) -> None:
        with self._loss_parallel():
            super().backward(loss)

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

    def eval_step(self, module: nn.Module, method: str, batch: Any, batch_idx: int) -> Any:
        if self.pipeline is None:
            return super().eval_step(module, method, batch, batch_idx)
        if method == "predict_step":
            raise ValueError(
                "predict under pp>1: the pipeline runs the model's loss on its last stage, not predict_step; "
                "allowed: predict with a layout without pipeline stages (pp=1)"
            )
        inputs, target = module.pipeline_batch(batch)
        with self._loss_parallel():
            out = self.pipeline.evaluate(inputs, target)
        return {"loss": out.loss, "num_tokens": out.num_tokens} if out.num_tokens is not None else out.loss

    # ---- gradients ---------------------------------------------------------------------------------
    def global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm over every shard, tp rank and stage: per mesh a DTensor norm (reduced over its
        shards), then the squares summed over the pipeline stages, which hold different parameters."""
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for g in grads:
            by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
        squares = torch.zeros((), device=self.root_device)
        for group in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(group, 2.0)
            squares = squares + (norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2
        if self.pp > 1:
            dist.all_reduce(squares, group=self.mesh.group("pp"))
        return squares.sqrt()

    def memory_report(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> MemoryReport:
        """This rank's bytes; the formula's ranks are those sharing a stage's parameters: FSDP's x tp's."""
        return measure(module, optimizer, self.zero_stage, self.group_size("dense") * self.tp)

    def teardown(self) -> None:
        self.pipeline = None
        super().teardown()
