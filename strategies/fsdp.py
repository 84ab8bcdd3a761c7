"""FSDPStrategy: ZeRO stages 1-3. Stages 2 and 3 shard with PyTorch's FSDP2 (`fully_shard`) per
transformer block; stage 1 keeps DDP's replicated parameters and gradients and shards only the
optimizer state (strategies/zero1.py). Checkpoints of every stage are torch.distributed.checkpoint
(DCP) directories (strategies/sharded_checkpoint.py): every rank writes only its own shards, nothing is
gathered, and any world size can load them.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from strategies import sharded_checkpoint
from strategies.activation_checkpointing import check_mode
from strategies.ddp import DDPStrategy
from strategies.memory import MemoryReport, measure
from strategies.meta_init import materialize
from strategies.parallel_dims import ParallelDims
from strategies.zero1 import SlicedParameters
from trainer import checkpoint as ckpt

# the methods the Trainer calls on the module: each runs FSDP's root pre/post-forward like `forward`
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class FSDPStrategy(DDPStrategy):
    """ZeRO-`zero_stage` data parallelism over all ranks, or hybrid (`replicate` > 1): shard within
    groups of world/replicate ranks and replicate across the groups (a 2-D mesh).

    - stage 3: parameters, gradients and optimizer states sharded; each block's parameters are gathered
      for its forward and backward and freed after (reshard_after_forward=True);
    - stage 2: as 3, but the gathered parameters stay from forward to backward (no second all-gather);
    - stage 1: only optimizer states sharded.
    Trainer precision "bf16-mixed" becomes FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 master
    weights and, with `reduce_dtype="fp32"`, fp32 gradient reduction). `cpu_offload` keeps shards and
    optimizer states in host memory. `activation_checkpointing` "full" recomputes each block in the
    backward, "selective" keeps matmul/attention outputs. With `async_save` a checkpoint is written in
    the background while training continues (the next save waits for it).
    """

    name = "fsdp"

    def __init__(
        self,
        zero_stage: int = 3,
        replicate: int = 1,
        reduce_dtype: str = "fp32",
        cpu_offload: bool = False,
        activation_checkpointing: str | None = None,
        async_save: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(timeout_s=timeout_s)
        if zero_stage not in (1, 2, 3) or isinstance(zero_stage, bool):
            raise ValueError(f"zero_stage={zero_stage!r} is invalid; allowed: 1, 2 or 3")
        if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
            raise ValueError(
                f"replicate={replicate!r} is invalid; allowed: an int >= 1 (hybrid sharding groups)"
            )
        if reduce_dtype not in ("fp32", "bf16"):
            raise ValueError(f"reduce_dtype={reduce_dtype!r} is invalid; allowed: 'fp32', 'bf16'")
        check_mode(activation_checkpointing)
        if cpu_offload and zero_stage == 1:
            raise ValueError(
                "cpu_offload=True needs zero_stage 2 or 3 (FSDP2's CPUOffloadPolicy); stage 1 cannot offload"
            )
        if replicate > 1 and zero_stage == 1:
            raise ValueError("replicate > 1 (hybrid sharding) needs zero_stage 2 or 3")
        self.zero_stage, self.replicate = zero_stage, replicate
        # stage 1 all-gathers parameters after the step; stages 2/3 all-gather them in the forward
        self.local_phases = ("data", "forward") if zero_stage == 1 else ("data", "optimizer")
        self.reduce_dtype = torch.float32 if reduce_dtype == "fp32" else torch.bfloat16
        self.cpu_offload, self.activation_checkpointing, self.async_save = (
            cpu_offload,
            activation_checkpointing,
            async_save,
        )
        self._sliced: SlicedParameters | None = None
        self._root: nn.Module | None = None  # the fully_shard-ed module (stages 2/3)
        self._step_methods: list[str] = []  # registered as FSDP forward methods on it

    def parallel_dims(self) -> ParallelDims:
        """Shard over all ranks, or within groups of world/replicate ranks, replicated across the groups."""
        return ParallelDims(dp_replicate=self.replicate, dp_shard=-1)

    def check_configuration(self) -> None:
        world, precision = self.devices * self.num_nodes, self.precision
        if world % self.replicate:
            raise ValueError(
                f"replicate={self.replicate} does not divide the world of {world} processes; allowed: a divisor of {world}"
            )
        if precision.name == "16-mixed" and self.zero_stage > 1:
            raise ValueError(
                "precision '16-mixed' needs a gradient scaler FSDP2 lacks; allowed with fsdp: '32', 'bf16-mixed', 'bf16-true'"
            )
        if self.zero_stage > 1 and precision.name == "bf16-mixed":
            precision.autocast_forward = False  # FSDP2 casts the gathered parameters itself
        super().check_configuration()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """`configure_model` builds on meta: nothing is allocated until each rank holds only its shards."""
        return torch.device("meta") if self.zero_stage > 1 else super().module_init_context()

    # ---- wrapping --------------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.zero_stage == 1:
            return super().setup_module(module)  # DDP; the optimizer state is sliced in setup_optimizer
        self.shard(module)
        if any(p.is_meta for p in module.parameters()):
            materialize(module, self.root_device)
        # A step reads root parameters outside `forward` (`self.net(x)`, a tied head): registered, each
        # step gathers them as `forward` would; `self(x)` inside it is a nested forward FSDP2 tolerates.
        self._root = module
        self._step_methods = [m for m in STEP_METHODS if hasattr(module, m)]
        for method in self._step_methods:
            register_fsdp_forward_method(module, method)
        return module

    def shard(self, module: nn.Module) -> nn.Module:
        """The order matters (TorchTitan's): checkpoint each block, compile it, then shard each block, then
        the root, so the checkpoint wraps the block's own computation and FSDP's hooks run around the
        compiled code."""
        module = self.precision.convert_module(module)
        self.fully_shard_units(self.prepare_blocks(module), module)
        return module

    def fully_shard_units(self, blocks: list[nn.Module], root: nn.Module) -> None:
        """Shard each block, then `root` (what is left), over the "dense" mesh (2-D with dp_replicate
        for hybrid sharding, else 1-D), each block prefetching the next one's parameters."""
        mesh = self.mesh.mesh("dense")
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.zero_stage == 3}
        if self.precision.name == "bf16-mixed":
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=self.reduce_dtype
            )
        if self.cpu_offload:
            # pinned host memory speeds GPU<->host copies; on a CPU run there is no device to copy from
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(root, **kwargs)
        for block, following in zip(blocks, blocks[1:], strict=False):
            block.set_modules_to_forward_prefetch([following])  # gather block i+1 while block i computes
        for block, previous in zip(blocks[1:], blocks, strict=False):
            block.set_modules_to_backward_prefetch([previous])

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.zero_stage > 1:
            return optimizer
        self._sliced = SlicedParameters(optimizer, self.dp_rank, self.dp_size, self.dp_group)
        return self._sliced.optimizer

    # ---- the step --------------------------------------------------------------------------------
    def call_step(self, module: nn.Module, method: str, *args: Any) -> Any:
        if self.zero_stage == 1:
            return super().call_step(module, method, *args)  # through DDP
        return getattr(module, method)(*args)  # registered: runs inside FSDP's pre/post-forward

    def accumulation_context(self, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        if self.zero_stage == 1:
            return super().accumulation_context(is_last_micro_batch)
        self._root.set_requires_gradient_sync(is_last_micro_batch)  # reduce-scatter once per step
        return contextlib.nullcontext()

    def global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        norm = super().global_norm(grads)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._sliced is None:
            return super().optimizer_step(optimizer)
        self._sliced.attach_gradients()
        stepped = super().optimizer_step(optimizer)
        self._sliced.gather_parameters()
        return stepped

    def memory_report(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> MemoryReport:
        """This rank's bytes in parameters, gradients and optimizer states, and the formula's."""
        return measure(module, optimizer, self.zero_stage, self.group_size("dense"))  # ranks sharing shards

    def startup_report(self, module: nn.Module) -> str:
        return self.memory_report(module, None).lines()

    # ---- checkpoints: every rank writes its own shards (MeshStrategy.save_checkpoint) ----------------
    @property
    def checkpoint_layout(self) -> str:
        return "zero1" if self.zero_stage == 1 else "state_dict"

    def checkpoint_payload(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> dict[str, Any]:
        if self.zero_stage > 1:
            return super().checkpoint_payload(module, optimizer)
        # stage 1: each rank's optimizer slices as they are (no gather), the replicated weights spread
        optim = self._sliced.sharded_state_dict(self.mesh.mesh("dense")) if optimizer is not None else None
        return {"model": module.state_dict(), **({"optim": optim} if optim is not None else {})}

    def reshard(self, module: nn.Module) -> None:
        # stage 2 keeps parameters gathered after a forward without backward (an eval step)
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def load_checkpoint(
        self, path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> dict[str, Any]:
        path = Path(path)
        if ckpt.read_meta(path).get("format") != "dcp":  # whole files (ZeRO-1's, before sharded saves)
            if self.zero_stage > 1:
                raise ckpt.CheckpointError(
                    f"checkpoint '{path}' is not a sharded checkpoint; a zero_stage {self.zero_stage} run "
                    "resumes from sharded ones (ddp, fsdp zero_stage 2/3, parallel3d)"
                )
            state = super().load_checkpoint(path, module, None)
            if optimizer is not None:
                self._sliced.load_full_state_dict(ckpt.load_torch_file(path / ckpt.OPTIMIZER_FILE))
            return state
        return super().load_checkpoint(path, module, optimizer)

    def load_sharded(self, path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if self.zero_stage > 1:
            return super().load_sharded(path, module, optimizer)
        self.begin_io(ckpt.manifest_bytes(path) // self.world_size)
        load = functools.partial(sharded_checkpoint.load, path=path, group=self.io_group)
        load({"model": module.state_dict()})
        if optimizer is not None:
            self._sliced.load_sharded(sharded_checkpoint.saved_entries(path), load, self.mesh.mesh("dense"))

    def teardown(self) -> None:
        self.finish_checkpoint()
        for method in self._step_methods:  # drop the instance attributes that registration added
            vars(self._root).pop(method, None)
        self._root, self._step_methods = None, []
        super().teardown()
