"""`layout_of`: the planner's Layout of a built strategy (a ParallelStrategy preset: DDP, FSDP, 3D), so a
recipe's run can be planned as the strategies will run it."""

from __future__ import annotations

from typing import Any

from strategies.plan.shapes import Layout

SCHEDULES = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved_1f1b"}  # the model's names


def layout_of(
    strategy: Any,
    world: int,
    precision: str,
    activation_checkpointing: str | None = None,
    loss_chunk_tokens: int | None = None,
) -> Layout:
    """The Layout of `strategy` (its ParallelDims resolved over `world` ranks, its ParallelOptions) under
    the Trainer's `precision` ("bf16-mixed"/"bf16-true": bf16, else fp32) and activation checkpointing
    (the strategy's own wins, as Strategy.set_block_options makes it)."""
    dims = strategy.parallel_dims().resolve(world)
    options = strategy.options
    schedule = SCHEDULES.get(options.pp_schedule) if dims.pp > 1 else "1f1b"
    if schedule is None:
        raise ValueError(
            f"pp_schedule={options.pp_schedule!r} is not in the memory model; allowed: {', '.join(SCHEDULES)}"
        )
    mode = getattr(strategy, "activation_checkpointing", None) or activation_checkpointing or "none"
    return Layout(
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        pp=dims.pp,
        cp=dims.cp,
        ep=dims.ep,
        zero_stage=max(options.zero_stage, 1),  # DDP's 0: dp_shard is 1, so nothing is sliced
        sequence_parallel=dims.tp > 1 and options.sequence_parallel,
        pp_schedule=schedule,
        pp_microbatches=options.microbatches if dims.pp > 1 else 1,
        activation_checkpointing=mode,
        loss_chunk_tokens=loss_chunk_tokens,
        precision="bf16" if precision.startswith("bf16") else "fp32",
        cpu_offload=options.cpu_offload,
    )
