"""`parallelize`: the one function that applies, in their one valid order, the parallel techniques a
ParallelDims asks for (each in strategies/techniques/), as TorchTitan's `parallelize_llama` does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from strategies.parallel_dims import ParallelMesh
from strategies.techniques.activation_checkpointing import transformer_blocks
from strategies.techniques.cp.apply import apply_cp
from strategies.techniques.cp.attention import ContextParallel
from strategies.techniques.ddp.apply import apply_ddp
from strategies.techniques.ep.apply import apply_ep
from strategies.techniques.ep.experts import expert_modules
from strategies.techniques.fsdp.apply import FSDPOptions, apply_fsdp, apply_fsdp_to_experts
from strategies.techniques.pp.apply import StageCut, apply_pp
from strategies.techniques.pp.stages import SCHEDULES, ZERO_BUBBLE
from strategies.techniques.tp.apply import apply_tp, quiet_norm_reduction
from trainer.core.precision import Precision

DATA_PARALLEL = ("ddp", "zero1", "fsdp")  # replicas, replicas with sliced optimizer state, FSDP2 shards


@dataclass(frozen=True)
class ParallelOptions:
    """How each technique runs, beyond its degree (the degrees are the ParallelDims)."""

    data_parallel: str = "fsdp"  # one of DATA_PARALLEL
    zero_stage: int = 3  # 0 for "ddp", 1 for "zero1", 2 or 3 for "fsdp"
    reduce_dtype: torch.dtype = torch.float32  # FSDP's gradient reduction under bf16 compute
    cpu_offload: bool = False
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)  # DistributedDataParallel's own knobs
    gradient_compression: str | None = None  # a DDP comm hook (strategies/techniques/ddp/apply.py)
    powersgd_rank: int = 1
    powersgd_start_iter: int = 10
    sequence_parallel: bool = True
    loss_parallel: bool = True
    pp_schedule: str = "1F1B"
    microbatches: int = 1
    pp_layers_per_stage: list[int] | None = None

    def __post_init__(self) -> None:
        stages = {"ddp": (0,), "zero1": (1,), "fsdp": (2, 3)}.get(self.data_parallel)
        if stages is None:
            raise ValueError(
                f"data_parallel={self.data_parallel!r} is unknown; allowed: {', '.join(DATA_PARALLEL)}"
            )
        if self.zero_stage not in stages:
            raise ValueError(
                f"zero_stage={self.zero_stage!r} does not fit data_parallel={self.data_parallel!r}; allowed: "
                f"{' or '.join(map(str, stages))}"
            )

    def n_stages(self, pp: int) -> int:
        """Pipeline stages over `pp` ranks: looped and V schedules hold more than one per rank."""
        return pp * SCHEDULES[self.pp_schedule]

    def zero_bubble(self, pp: int) -> bool:
        """A zero-bubble pipeline: its stages run without FSDP (their deferred weight gradients)."""
        return pp > 1 and self.pp_schedule in ZERO_BUBBLE


@dataclass
class Parallelized:
    """What `parallelize` made besides changing the module in place: the wrappers the step runs through."""

    module: nn.Module
    ddp: DistributedDataParallel | None = None  # "ddp"/"zero1": the step runs through it
    context: ContextParallel | None = None  # cp > 1: shards each batch's sequence
    views: list[nn.Module] = field(default_factory=list)  # pp > 1: this rank's stages
    stage_ids: list[int] = field(default_factory=list)


def parallelize(
    module: nn.Module,
    mesh: ParallelMesh,
    options: ParallelOptions,
    precision: Precision,
    device: torch.device,
    prepare_blocks: Callable[[nn.Module], list[nn.Module]],
    watch: Callable[[torch.Tensor], None] | None = None,
) -> Parallelized:
    """Apply to `module`, in place, every technique `mesh.dims` asks for, in this order.
    `prepare_blocks` applies activation checkpointing, then compile, to the model's blocks and returns
    them as they then sit in the model (Strategy.prepare_blocks). `watch`, with replicas, gets each
    gradient bucket's squared norm before DDP all-reduces it (Strategy.watch_local_gradients)."""
    dims, sharded = mesh.dims, options.data_parallel == "fsdp"
    # A sharded model may be built on meta: it is materialised after sharding, shard by shard, so it is
    # not moved here. Replicas are moved whole before DDP, which broadcasts rank 0's values.
    module = precision.convert_module(module if sharded else module.to(device))
    done = Parallelized(module)
    # Context parallel only swaps every attention's kernel and positions: before the cut, so whichever
    # layers a stage keeps have them.
    if dims.cp > 1:
        done.context = apply_cp(module, mesh.group("cp"), mesh.rank("cp"), dims.cp, device)
    # The pipeline cut comes first of the techniques that change parameters: the others then work on this
    # rank's stages only (nothing is planned, sharded or compiled for layers another rank holds).
    cut: StageCut | None = None
    if dims.pp > 1:
        n = options.n_stages(dims.pp)
        cut = apply_pp(module, n, options.pp_schedule, mesh.rank("pp"), dims.pp, options.pp_layers_per_stage)
    # Tensor parallel before expert parallel: the model's plan routes each tp rank's own sequence shard,
    # which the all-to-all then exchanges; and both before FSDP, which shards the DTensors they make.
    if dims.tp > 1:
        apply_tp(module, mesh.mesh("tp"), options.sequence_parallel, options.loss_parallel)
    if dims.ep > 1:
        apply_ep(module, mesh.mesh("ep"), mesh.group("ep"))
    # Activation checkpointing, then compile, on each block: the checkpoint wraps the block's own
    # computation, and FSDP's hooks (next) run around the compiled code rather than inside it.
    blocks = prepare_blocks(module)
    if cut is not None:
        done.views, done.stage_ids = (
            cut.views(),
            cut.ids,
        )  # after tp/ep/AC: the views see the parts as they train
    # Data parallel last: it wraps or shards what the techniques before left.
    if not sharded:
        done.ddp = apply_ddp(
            module,
            mesh.group("batch"),
            device,
            options.ddp_kwargs,
            options.gradient_compression,
            options.powersgd_rank,
            options.powersgd_start_iter,
            watch,
        )
        return done  # "zero1" slices the optimizer state when the optimizer exists (setup_optimizer)
    quiet_norm_reduction()
    fsdp = FSDPOptions(
        options.zero_stage, precision.name == "bf16-mixed", options.reduce_dtype, options.cpu_offload
    )
    dense = mesh.mesh("dense")
    if cut is None:
        _shard_experts(module, mesh, fsdp, device)
        apply_fsdp(blocks, module, dense, fsdp, device)
    elif not options.zero_bubble(dims.pp):  # zero-bubble stages run unsharded (ParallelStrategy's check)
        for view in done.views:  # FSDP per stage: each stage's own root, its own parameter groups
            _shard_experts(view, mesh, fsdp, device)
            apply_fsdp(transformer_blocks(view), view, dense, fsdp, device)
    return done


def _shard_experts(module: nn.Module, mesh: ParallelMesh, fsdp: FSDPOptions, device: torch.device) -> None:
    """Experts first, as FSDP units of their own over the "expert" mesh, when ep or tp made their
    sharding differ from the dense parameters'; their blocks then take the rest."""
    dims = mesh.dims
    experts = [layer.experts for layer in expert_modules(module)]  # a stage view: its own layers
    if experts and (dims.ep > 1 or dims.tp > 1):
        factor = float(dims.dp_replicate * dims.dp_shard * dims.cp)
        apply_fsdp_to_experts(experts, mesh.mesh("expert"), fsdp, device, factor, mesh.size("expert"))
