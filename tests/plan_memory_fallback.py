"""A closed-form per-rank memory estimate for the planner's tests, standing in for strategies/plan/memory.py
(the memory model, written on another branch) until it is merged: `install()` puts it in its place only when
that module is missing, so once the real model lands the tests run against it unchanged.

Weights, gradients and AdamW state at 16 bytes a parameter in bf16-mixed (fp32 master, fp32 gradients, two
fp32 states) split as the ZeRO stage splits them; activations by Korthikanti et al. 2022 (34 s b h bytes a
block in 16 bits, 2 s b h with full recompute), times the micro-batches 1F1B keeps in flight; the logits
and their gradient in fp32 on the last stage.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

from strategies.plan.shapes import Layout, ModelShape, RunShape
from strategies.plan.step_time import dense_params, expert_params


@dataclass(frozen=True)
class Estimate:
    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def peak(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def per_rank_memory(shape: ModelShape, layout: Layout, run: RunShape) -> Estimate:
    """Bytes one rank holds at its peak (see the module's docstring)."""
    L = layout
    n = dense_params(shape) / (L.tp * L.pp) + expert_params(shape) / (L.pp * L.ep)
    shard = L.dp_shard * L.cp
    wide = 4 if L.precision == "fp32" else 2
    if L.dp_shard == 1:  # DDP or replicas: nothing sharded
        params, grads, optimizer = 4 * n, 4 * n, 8 * n
    elif L.zero_stage == 1:
        params, grads, optimizer = 4 * n, 4 * n, 8 * n / shard
    elif L.zero_stage == 2:  # the gathered compute copy lives from the forward to the backward
        params, grads, optimizer = 4 * n / shard + wide * n, 4 * n / shard, 8 * n / shard
    else:  # two gathered blocks at a time (one prefetched)
        params, grads, optimizer = (
            4 * n / shard + 2 * wide * n / (shape.n_layers / L.pp),
            4 * n / shard,
            8 * n / shard,
        )
    seqs = run.micro_batch / L.pp_microbatches  # a pipeline cuts the batch into micro-batches
    tokens = seqs * run.seq_len / L.cp / (L.tp if L.sequence_parallel else 1)
    per_block = (
        {"none": 34, "selective": 24, "full": 2}[L.activation_checkpointing] * tokens * shape.dim * wide / 2
    )
    in_flight = L.pp if L.pp > 1 else 1
    blocks = shape.n_layers / L.pp
    acts = per_block * blocks * in_flight
    if L.activation_checkpointing == "full":  # one block's forward rerun in full
        acts += 34 * tokens * shape.dim * wide / 2
    logits = 2 * 4 * seqs * run.seq_len / L.cp * shape.vocab_size / L.tp
    return Estimate(params, grads, optimizer, acts + logits)


def missing() -> bool:
    """Whether strategies/plan/memory.py is absent (this estimate then stands in for it)."""
    import importlib.util

    return importlib.util.find_spec("strategies.plan.memory") is None


def as_module() -> types.ModuleType:
    """This estimate as a module `strategies.plan.memory` (for sys.modules)."""
    module = types.ModuleType("strategies.plan.memory")
    module.per_rank_memory = per_rank_memory
    return module


def install() -> None:
    """In a process the tests start: the estimate as strategies.plan.memory when that module is absent."""
    if missing():
        sys.modules["strategies.plan.memory"] = as_module()
