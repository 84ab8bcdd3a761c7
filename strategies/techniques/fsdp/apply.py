"""Sharded data parallel (ZeRO 2/3) with PyTorch's FSDP2: `fully_shard` per transformer block, then the
root; MoE experts as units of their own over the "expert" mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.core.dtensors import local_part

if TYPE_CHECKING:
    from torch.distributed.tensor import Shard


@dataclass(frozen=True)
class FSDPOptions:
    """How FSDP2 shards: stage 3 reshards after the forward (stage 2 keeps the gathered parameters until
    the backward); bf16 compute with `reduce_dtype` gradient reduction; shards in host memory."""

    zero_stage: int = 3
    bf16_compute: bool = False  # the Trainer's precision "bf16-mixed"
    reduce_dtype: torch.dtype = torch.float32
    cpu_offload: bool = False

    def kwargs(self, mesh: DeviceMesh, device: torch.device) -> dict[str, Any]:
        """`fully_shard`'s arguments over `mesh` (the one place the MixedPrecisionPolicy is written)."""
        # FSDP2 imports DTensor (~0.4 s of start-up): imported here, so importing this module does not
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.zero_stage == 3}
        if self.bf16_compute:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=self.reduce_dtype
            )
        if self.cpu_offload:
            # pinned host memory speeds GPU<->host copies; on a CPU run there is no device to copy from
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        return kwargs


def apply_fsdp(
    blocks: list[nn.Module], root: nn.Module, mesh: DeviceMesh, options: FSDPOptions, device: torch.device
) -> None:
    """Shard each block, then `root` (what is left), over `mesh` (2-D with dp_replicate for hybrid
    sharding, else 1-D), each block prefetching the next one's parameters."""
    from torch.distributed.fsdp import fully_shard

    kwargs = options.kwargs(mesh, device)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(root, **kwargs)
    for block, following in zip(blocks, blocks[1:], strict=False):
        block.set_modules_to_forward_prefetch([following])  # gather block i+1 while block i computes
    for block, previous in zip(blocks[1:], blocks, strict=False):
        block.set_modules_to_backward_prefetch([previous])


def init_root(root: nn.Module) -> None:
    """Make `root` FSDP2's root now (idempotent). FSDP2 takes the first module to run forward as the root;
    a step that runs outside the root's forward (manual optimization) may first call one of its units."""
    root._get_fsdp_state()._lazy_init()  # FSDP2 has no public call for it (torch 2.13)


def apply_fsdp_to_experts(
    experts: list[nn.Module],
    mesh: DeviceMesh,
    options: FSDPOptions,
    device: torch.device,
    divide_factor: float,
    shards: int,
) -> None:
    """The experts of MoE layers as FSDP units of their own over the "expert" `mesh` (before their blocks
    take the rest). An expert's gradient sums the tokens of every ep rank, and the "expert" mesh holds the
    tp ranks that ep does not (their sequence shards, routed through replicated experts); so FSDP divides
    it by `divide_factor`, the data-parallel degree of the dense parameters (dp_replicate*dp_shard*cp),
    not by the size of the "expert" mesh: both then hold the gradient of the global mean loss (TorchTitan
    does the same). `shards`: the ranks of the mesh's shard dim (under HSDP the replicas hold copies). Each
    weight is sharded on the dim `_expert_placement` picks. The gradient's divide
    factor, the norm (DTensor, over every mesh dim) and DCP (each shard's global offsets from its
    placements) do not depend on which dim that is."""
    from torch.distributed.fsdp import fully_shard

    kwargs = options.kwargs(mesh, device)
    kwargs["shard_placement_fn"] = lambda param: _expert_placement(param, shards)
    for unit in experts:
        fully_shard(unit, **kwargs)
        unit.set_gradient_divide_factor(divide_factor)
        # gloo has no PREMUL_SUM: reduce by SUM, then divide. Not on a 1-rank "expert" mesh, where
        # FSDP (torch 2.13) skips the reduce-scatter, divides in its copy and would divide again.
        if device.type == "cpu" and shards > 1:
            unit.set_force_sum_reduction_for_comms(True)


def _expert_placement(param: torch.Tensor, shards: int) -> Shard:
    """FSDP's placement of an expert weight (E/ep local experts, in, out) over `shards` ranks: dim 0, whole
    experts per rank, when the local experts divide; else dim 1 (the model dim or ffn, in practice a multiple
    of `shards`). FSDP pads an uneven dim 0 to ceil(E/ep / shards) experts on every rank (Mixtral's 8 at ep=8
    over an 8-rank "expert" mesh: 8 ranks each store a whole expert, 7 of them zeros) but refuses an uneven
    dim 1, so dim 0 stays where neither divides. Dim 1 costs a copy around each all-gather and reduce-scatter
    (FSDP regroups the ranks' slices): the exception, not the rule. (TorchTitan's rule, ep * shards > E,
    keeps dim 0 for E/ep = 3 over 2 ranks, padded to 4.)"""
    from torch.distributed.tensor import Shard

    local = local_part(param)
    return Shard(1) if local.shape[0] % shards and local.shape[1] % shards == 0 else Shard(0)


def check_reduce_dtype(name: str) -> torch.dtype:
    """FSDP's gradient-reduction dtype of a strategy's `reduce_dtype` name; a one-line error if unknown."""
    if name not in ("fp32", "bf16"):
        raise ValueError(f"reduce_dtype={name!r} is invalid; allowed: 'fp32', 'bf16'")
    return torch.float32 if name == "fp32" else torch.bfloat16
