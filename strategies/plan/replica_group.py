"""What live recovery needs of a planned layout: its checkpoint's size (one copy of the training state, from
the memory model) and its smallest replica group (torchft's unit of failure: HSDP, FSDP inside a group and
replicas across groups; the smaller the group, the less throughput a lost one takes with it)."""

from __future__ import annotations

from dataclasses import replace

from strategies.plan.memory import per_rank_memory, per_stage_memory
from strategies.plan.search import USABLE_MEMORY, divisors
from strategies.plan.shapes import Layout, ModelShape, RunShape


def checkpoint_bytes(shape: ModelShape, layout: Layout, run: RunShape) -> int:
    """Bytes of one copy of the training state (parameters and optimizer state; replicas hold copies):
    each pipeline rank's part times the ranks that split it (cp x tp x dp_shard). CPU offload moves the
    state to the host, where a checkpoint reads it all the same."""
    stages = per_stage_memory(shape, replace(layout, cpu_offload=False), run)
    split = layout.dp_shard * layout.cp * layout.tp
    return split * sum(s.params + s.optimizer for s in stages)


def smallest_group(
    shape: ModelShape, layout: Layout, run: RunShape, memory_bytes: float, gpus_per_node: int
) -> int:
    """GPUs of the smallest replica group of `layout` that fits `memory_bytes` a GPU: the layout with its
    FSDP dimension cut to the smallest divisor whose peak fits (tp, pp, cp, the micro-batch kept), and at
    least a node (a node's failure then takes one group, not several) unless one replica is smaller."""
    model_parallel = layout.tp * layout.pp * layout.cp
    replica = model_parallel * layout.dp_shard
    for shard in divisors(layout.dp_shard):
        group = model_parallel * shard
        # the experts are split over ep ranks carved out of dp_shard x cp x tp (strategies/plan/search.py)
        if group < min(gpus_per_node, replica) or (shard * layout.cp * layout.tp) % layout.ep:
            continue
        peak = per_rank_memory(shape, replace(layout, dp_shard=shard, dp_replicate=1), run).peak
        if peak <= USABLE_MEMORY * memory_bytes:
            return group
    return replica
