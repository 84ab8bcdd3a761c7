"""FSDPStrategy: ZeRO stages 1-3. Stages 2 and 3 shard with PyTorch's FSDP2 (`fully_shard`) per
transformer block; stage 1 keeps DDP's replicated parameters and gradients and shards only the
optimizer state (strategies/techniques/zero1/). Checkpoints of every stage are torch.distributed.checkpoint
(DCP) directories (strategies/checkpoint_io/dcp_files.py): every rank writes only its own shards, nothing
is gathered, and any world size can load them.
"""

from __future__ import annotations

from strategies.parallel import ParallelStrategy
from strategies.parallel_dims import ParallelDims
from strategies.parallelize import ParallelOptions
from strategies.techniques.activation_checkpointing import check_mode
from strategies.techniques.fsdp.apply import check_reduce_dtype


class FSDPStrategy(ParallelStrategy):
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
        if zero_stage not in (1, 2, 3) or isinstance(zero_stage, bool):
            raise ValueError(f"zero_stage={zero_stage!r} is invalid; allowed: 1, 2 or 3")
        if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
            raise ValueError(
                f"replicate={replicate!r} is invalid; allowed: an int >= 1 (hybrid sharding groups)"
            )
        if cpu_offload and zero_stage == 1:
            raise ValueError(
                "cpu_offload=True needs zero_stage 2 or 3 (FSDP2's CPUOffloadPolicy); stage 1 cannot offload"
            )
        if replicate > 1 and zero_stage == 1:
            raise ValueError("replicate > 1 (hybrid sharding) needs zero_stage 2 or 3")
        options = ParallelOptions(
            data_parallel="zero1" if zero_stage == 1 else "fsdp",
            zero_stage=zero_stage,
            reduce_dtype=check_reduce_dtype(reduce_dtype),
            cpu_offload=cpu_offload,
        )
        super().__init__(
            ParallelDims(dp_replicate=replicate, dp_shard=-1),  # shard over the rest of the world
            options,
            activation_checkpointing=check_mode(activation_checkpointing),
            async_save=async_save,
            timeout_s=timeout_s,
        )
