"""The Llama's tensor-parallel plan (Megatron's layout, TorchTitan's plan), declared beside the model;
strategies/parallel3d.py applies it with `parallelize_module`.

q/k/v and the SwiGLU up-projections are split column-wise, wo and w2 row-wise, so each block needs one
reduction after attention and one after the MLP. With `sequence_parallel` the norms run on sequence
shards (activations between blocks are split over the tp ranks) and the reductions become
reduce-scatters; with `loss_parallel` the logits stay sharded over the vocabulary for a
vocabulary-parallel cross-entropy.

A MoE feed-forward is not split: it takes this rank's shard of the sequence (sliced from the replicated
activations without `sequence_parallel`) and routes those tokens itself (TorchTitan's ETP=1), its router
and shared experts replicated over the tp ranks (their gradients partial sums), its experts split by
expert parallelism, whose ranks include the tp ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from trainer.models.moe import MoE
from trainer.models.sequence_gather import GatherKeepingShard

if TYPE_CHECKING:
    from trainer.models.llama import Llama


def tensor_parallel_plan(model: Llama, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
    """Module path (within `model`, whole or one pipeline stage's) -> DTensor parallel style."""
    between = Shard(1) if sequence_parallel else Replicate()  # activations between the blocks
    plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:  # a pipeline stage may lack the ends
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.output is not None:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,  # a DTensor is what loss_parallel() reads
        )
    for name, block in model.layers.items():
        plan.update(_block_plan(f"layers.{name}.", block, between, sequence_parallel))
    return plan


def _block_plan(prefix: str, block: nn.Module, between: Placement, sequence_parallel: bool) -> dict[str, Any]:
    """One transformer block's styles: attention split by heads, the feed-forward by width (dense) or
    left whole on this rank's tokens (MoE)."""
    moe = isinstance(block.feed_forward, MoE)
    plan: dict[str, Any] = {}
    for linear in ("attention.wq", "attention.wk", "attention.wv"):
        plan[prefix + linear] = ColwiseParallel()
    plan[prefix + "attention.wo"] = RowwiseParallel(output_layouts=between)
    if moe:
        plan.update(_moe_plan(prefix + "feed_forward", block.feed_forward, between))
    else:
        plan[prefix + "feed_forward.w1"] = ColwiseParallel()
        plan[prefix + "feed_forward.w3"] = ColwiseParallel()
        plan[prefix + "feed_forward.w2"] = RowwiseParallel(output_layouts=between)
    if sequence_parallel:
        plan[prefix + "attention_norm"] = SequenceParallel()
        plan[prefix + "ffn_norm"] = SequenceParallel()
        # gather the sequence before the column-parallel projections (cos/sin pass untouched); they keep
        # this rank's shard for their backward, not the gathered sequence
        plan[prefix + "attention"] = GatherKeepingShard()
        if not moe:
            plan[prefix + "feed_forward"] = GatherKeepingShard()
    return plan


def _moe_plan(prefix: str, moe: MoE, between: Placement) -> dict[str, Any]:
    """A MoE feed-forward computes this rank's shard of the sequence with replicated weights."""
    plan: dict[str, Any] = {
        prefix: PrepareModuleInputOutput(
            input_layouts=(between,),
            desired_input_layouts=(Shard(1),),
            use_local_input=False,  # a DTensor: the MoE learns which ranks hold the other shards
            output_layouts=(Shard(1),),
            desired_output_layouts=(between,),
        ),
        # replicated weights applied to token shards (the router reads its gate as a local weight)
        prefix + ".router.gate": SequenceParallel(sequence_dim=0),
    }
    if moe.shared_experts is not None:
        for linear in ("w1", "w2", "w3"):
            plan[prefix + f".shared_experts.{linear}"] = SequenceParallel(
                sequence_dim=0, use_local_output=True
            )
    return plan
