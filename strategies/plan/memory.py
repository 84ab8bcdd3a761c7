"""The memory of one rank under a layout, predicted from the model's shapes: what it stores (parameters,
gradients, optimizer state), what a step's forward keeps for the backward (activations), and the largest
short-lived buffer on top of them (a gathered FSDP unit, the logits, a recomputed block), at each of the
moments a step peaks. Written once from the shapes for every layout: each technique only changes how many
of which tensors a rank holds (strategies/parallelize.py applies them; tensors.py counts them).

The moments (a step's memory peaks at one of them):
- "backward": the forward has finished, the backward starts at the loss: every saved activation of the
  micro-batches in flight, the parameters FSDP holds gathered then, and the loss's buffers.
- "block backward": the last block's backward (recomputed first when checkpointed): the gradients made so
  far and FSDP's working set (gathered units, unsharded gradients, the reduce-scatter's copy).
- "pipeline backward" (pp with FSDP): the stage's parameters gathered and its gradients unsharded, held
  across the step's micro-batches.
- "optimizer": the backward is done: every gradient, the optimizer state and the step's temporaries.
On the CPU the optimizer's temporaries are torch's per-tensor AdamW's (two fp32 copies of the largest
tensor); CUDA's fused AdamW (trainer/core/fused_optim.py) has none, so there this moment is overestimated.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from strategies.plan.shapes import (
    ACTIVATION_CHECKPOINTING,
    FSDP_UNITS,
    WHAT_IF_CHECKPOINTING,
    Layout,
    ModelShape,
    RunShape,
)
from strategies.plan.tensors import (
    FP32,
    Unit,
    block_checkpointed_bytes,
    block_saved_bytes,
    block_unit,
    compute_bytes,
    is_moe_layer,
    root_unit,
    runs_fsdp,
    stream_bytes,
)
from strategies.techniques.pp.stages import split_blocks, stage_ids

SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}  # strategies'
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}  # fp32 tensors per parameter element


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at its peak (for pp: the worst stage's rank), by what they are."""

    params: int  # the parameters it stores (FSDP: its padded shards; offloaded: 0)
    grads: int  # its gradients once the backward is done (DDP: the buckets, held all along)
    optimizer: int  # the optimizer's state
    activations: int  # what the forwards of the micro-batches in flight keep for the backward
    transient: int  # the largest short-lived buffer at the peak
    transient_name: str  # what it is ("logits", "gathered FSDP units", ...)
    peak: int  # the most bytes live at once
    moment: str  # when the peak is: "backward", "block backward", "pipeline backward" or "optimizer"
    stage: int = 0  # the pipeline rank this is (the worst one)

    def line(self) -> str:
        """One line: the parts and the peak, in GiB or MiB."""
        return (
            f"params {_size(self.params)} + grads {_size(self.grads)} + optimizer {_size(self.optimizer)} + "
            f"activations {_size(self.activations)} + {self.transient_name} {_size(self.transient)}: peak "
            f"{_size(self.peak)} at the {self.moment}"
        )


def per_rank_memory(shape: ModelShape, layout: Layout, run: RunShape) -> MemoryEstimate:
    """The peak memory of one rank of `layout` training `shape` on `run`'s batches (the worst pipeline stage).
    `run.micro_batch` is the batch of one forward-backward on a data-parallel rank; a pipeline splits it
    into `layout.pp_microbatches`."""
    return max(per_stage_memory(shape, layout, run), key=lambda s: s.peak)


def per_stage_memory(shape: ModelShape, layout: Layout, run: RunShape) -> list[MemoryEstimate]:
    """`per_rank_memory` of a rank of each pipeline rank 0..pp-1 (one item without a pipeline)."""
    _check(shape, layout, run)
    n_stages = layout.pp * layout.stages_per_rank
    cut = split_blocks(list(range(shape.n_layers)), n_stages)
    kinds = _BlockKinds(shape, layout)
    return [_stage_memory(shape, layout, run, rank, cut, kinds) for rank in range(layout.pp)]


class _BlockKinds:
    """A layout's block units, one per kind of block (dense or MoE: every block of a kind has the same
    shapes), so that a model of 80 or 128 blocks is counted per kind, not per block: `trainer plan` tries
    thousands of layouts. A kind's unit stands for each of its blocks (it carries the first one's name)."""

    def __init__(self, shape: ModelShape, layout: Layout) -> None:
        self.shape, self.layout = shape, layout
        self.units: dict[bool, Unit] = {}

    def unit(self, layer: int) -> Unit:
        moe = is_moe_layer(self.shape, layer)
        if moe not in self.units:
            self.units[moe] = block_unit(self.shape, self.layout, layer)
        return self.units[moe]

    def first_of_each(self, layers: list[int]) -> dict[int, int]:
        """One layer of each kind among `layers` (its first) -> how many of `layers` are of its kind."""
        if not self.shape.n_experts:  # a dense model: one kind (not a look at each of 80 blocks' kind)
            return {layers[0]: len(layers)} if layers else {}
        counts = Counter(is_moe_layer(self.shape, i) for i in layers)
        first = {is_moe_layer(self.shape, i): i for i in reversed(layers)}
        return {first[moe]: n for moe, n in counts.items()}


def _check(shape: ModelShape, layout: Layout, run: RunShape) -> None:
    problems = []
    if layout.pp_schedule not in SCHEDULE_NAMES:
        problems.append(f"pp_schedule={layout.pp_schedule!r}; allowed: {', '.join(SCHEDULE_NAMES)}")
    modes = ACTIVATION_CHECKPOINTING + WHAT_IF_CHECKPOINTING
    if layout.activation_checkpointing not in modes:
        problems.append(
            f"activation_checkpointing={layout.activation_checkpointing!r}; allowed: {', '.join(modes)}"
        )
    elif layout.activation_checkpointing in WHAT_IF_CHECKPOINTING and shape.n_experts:
        problems.append(
            f"activation_checkpointing={layout.activation_checkpointing!r} with experts; allowed: a dense model"
        )
    if layout.precision not in ("bf16", "fp32"):
        problems.append(f"precision={layout.precision!r}; allowed: bf16, fp32")
    if run.optimizer not in OPTIMIZER_STATES:
        problems.append(f"optimizer={run.optimizer!r}; allowed: {', '.join(OPTIMIZER_STATES)}")
    if layout.fsdp_unit not in FSDP_UNITS:
        problems.append(f"fsdp_unit={layout.fsdp_unit!r}; allowed: {', '.join(FSDP_UNITS)}")
    if layout.zero_stage not in (1, 2, 3):
        problems.append(f"zero_stage={layout.zero_stage!r}; allowed: 1, 2 or 3")
    if shape.n_experts and shape.n_experts % layout.ep:
        problems.append(f"ep={layout.ep} does not divide n_experts={shape.n_experts}; allowed: a divisor")
    if layout.pp_microbatches < 1 or run.micro_batch % layout.pp_microbatches:
        problems.append(
            f"pp_microbatches={layout.pp_microbatches} does not divide micro_batch={run.micro_batch}; allowed: a divisor"
        )
    if problems:
        raise ValueError("memory model: " + "; ".join(problems))


def _stage_memory(
    shape: ModelShape, layout: Layout, run: RunShape, pp_rank: int, cut: list[list[int]], kinds: _BlockKinds
) -> MemoryEstimate:
    """The peak of a rank of pipeline rank `pp_rank`: its stages' units (`cut`: each stage's blocks),
    sharded as the layout says."""
    schedule = SCHEDULE_NAMES[layout.pp_schedule]
    n_stages = len(cut)
    ids = stage_ids(schedule, pp_rank, layout.pp) if layout.pp > 1 else [0]
    layers = [layer for i in ids for layer in cut[i]]
    each = kinds.first_of_each(layers)  # a layer of each kind -> its count
    blocks = [(kinds.unit(i), n) for i, n in each.items()]  # each kind's unit, and its count
    last_block = kinds.unit(layers[-1]) if layers else None
    roots = [root_unit(shape, layout, i == 0, i == n_stages - 1) for i in ids]
    shard = _Sharding(layout, shape.dim)

    # what the rank stores across steps (FSDP: shards; DDP/ZeRO-1: whole replicas)
    counted = blocks + [(u, 1) for u in roots]
    params = sum(n * shard.stored(u) for u, n in counted) * FP32
    grads = params
    optimizer = OPTIMIZER_STATES[run.optimizer] * sum(n * shard.optimizer_numel(u) for u, n in counted) * FP32
    if layout.cpu_offload:  # FSDP's CPUOffloadPolicy: shards, gradients and the optimizer step on the host
        params = grads = optimizer = 0

    # one pipeline micro-batch's tokens on this rank (context parallel: its part of the sequence)
    micro = run.micro_batch // layout.pp_microbatches
    tokens = micro * run.seq_len // layout.cp
    in_flight = _in_flight(layout, pp_rank, len(ids))
    per_micro = sum(n * _kept(shape, layout, i, tokens) for i, n in each.items())
    first, last = 0 in ids, n_stages - 1 in ids
    per_micro += _ends_saved(shape, layout, tokens, first, last)
    activations = in_flight * per_micro

    # bf16 autocast's copies of the matmul weights, which the matmuls keep for their backward (FSDP's
    # mixed precision gathers bf16 parameters instead: nothing to cast)
    cast = 2 * sum(n * u.cast for u, n in counted) if layout.precision == "bf16" and not shard.fsdp else 0
    resident = params + optimizer + (grads if shard.buckets else 0) + activations + cast
    loss = _loss_bytes(shape, layout, tokens) if last else 0
    at_loss = shard.gathered_at_loss(blocks, last_block, roots)
    moments = {
        "backward": (
            resident + loss + at_loss,
            *max((loss, "logits of the loss"), (at_loss, "gathered FSDP units")),
        )
    }
    # the first block's backward (recomputed first when checkpointed): the loss's buffers are gone; the
    # gradients made so far (the output projection's) and FSDP's working set are there
    recompute = max(block_saved_bytes(shape, layout, i, tokens) for i in each)
    redo = recompute if layout.activation_checkpointing != "none" else 0
    working = shard.backward_working_set(blocks, last_block, roots, last)
    name = (
        "recomputed block"
        if redo > working
        else "gradients so far" + (" and FSDP's gathered units" if shard.fsdp else "")
    )
    moments["block backward"] = (resident + redo + working, max(redo, working), name)
    if layout.pp > 1 and shard.fsdp:
        # a pipeline holds its stages gathered, and their gradients unsharded, across the micro-batches
        # of a step (the reduce-scatter waits for the last one)
        whole = sum(n * (u.numel + u.expert_numel) for u, n in counted)
        held = whole * (compute_bytes(layout) + FP32)
        one = resident - activations + per_micro + loss  # the last micro-batch's backward
        moments["pipeline backward"] = (one + held, held, "pipeline's gathered stage and its gradients")
    opt_transient, opt_name = shard.optimizer_transient([u for u, _ in counted], run)
    moments["optimizer"] = (params + grads + optimizer + opt_transient, opt_transient, opt_name)
    moment = max(moments, key=lambda m: moments[m][0])
    peak, transient, name = moments[moment]
    return MemoryEstimate(params, grads, optimizer, activations, transient, name, peak, moment, pp_rank)


def _kept(shape: ModelShape, layout: Layout, layer: int, tokens: int) -> int:
    if layout.activation_checkpointing == "none":
        return block_saved_bytes(shape, layout, layer, tokens)
    return block_checkpointed_bytes(shape, layout, layer, tokens)


def _ends_saved(shape: ModelShape, layout: Layout, tokens: int, first: bool, last: bool) -> int:
    """The embedding's and the final norm's saved tensors: token ids, and the norm's fp32 input, normalised
    value (block_saved_bytes' norms) and output (the output projection's input; the chunked loss keeps none
    of it but its own gradients)."""
    sp = layout.tp if layout.sequence_parallel else 1
    saved = tokens * 8 if first else 0
    if last:
        saved += tokens * shape.dim * (FP32 + stream_bytes(layout)) // sp
        if layout.loss_chunk_tokens is None:
            saved += tokens * shape.dim * compute_bytes(layout)
    return saved


def _loss_bytes(shape: ModelShape, layout: Layout, tokens: int) -> int:
    """The loss's buffers at the start of the backward. Full logits (fp32, vocabulary-split under tp's
    loss parallel): the log-softmax kept for the backward, its gradient and the logits' gradient, three
    at once. Chunked (trainer/models/linear_cross_entropy.py): the gradients it made in its forward (the
    hidden states' in the compute dtype, the output weight's in fp32) and one chunk's fp32 logits."""
    v = shape.vocab_size // layout.tp
    if layout.tp > 1:  # loss parallel (never chunked): torch's vocabulary-parallel log-softmax keeps
        return 5 * tokens * v * FP32  # the shifted logits and their exp, its backward two more and the sum
    if layout.loss_chunk_tokens is None:
        return 3 * tokens * v * FP32
    chunk = min(layout.loss_chunk_tokens, tokens)
    return tokens * shape.dim * compute_bytes(layout) + v * shape.dim * FP32 + 2 * chunk * v * FP32


def _in_flight(layout: Layout, pp_rank: int, stages_here: int) -> int:
    """Micro-batches whose activations a stage of `pp_rank` holds at once: GPipe all of them; 1F1B the
    warm-up's p - rank; interleaved 1F1B (per stage of its two) its longer warm-up, as chunks."""
    m, p = layout.pp_microbatches, layout.pp
    if p == 1:
        return m if m > 1 else 1
    if layout.pp_schedule == "gpipe":
        return m
    if layout.pp_schedule == "1f1b":
        return min(m, p - pp_rank)
    warmup = min(m * stages_here, 2 * (p - pp_rank - 1) + (stages_here - 1) * p + 1)
    return math.ceil(warmup / stages_here)


class _Sharding:
    """How a layout's data parallelism splits a unit: FSDP (ZeRO 2/3) over the dense mesh (dp_shard x cp,
    experts over the expert mesh), ZeRO-1 (DDP with the optimizer state sliced), DDP. ZeRO-3 gathers a
    block's parameters all at once, or one tensor at a time (`fsdp_unit` "linear", DeepSpeed's way)."""

    def __init__(self, layout: Layout, dim: int) -> None:
        self.layout, self.layout_dim = layout, dim
        self.dense = layout.dp_shard * layout.cp
        # experts: dp_shard x cp x tp ranks hold the layer; ep of them split the experts, FSDP the rest
        self.expert = max(1, layout.dp_shard * layout.cp * layout.tp // layout.ep)
        self.fsdp = runs_fsdp(layout)
        # DDP's gradient buckets (the gradients are views of them) live across steps; one process has none
        self.buckets = not self.fsdp and layout.world > 1

    def piece(self, unit: Unit) -> int:
        """Elements of `unit` ZeRO-3 gathers at once: all of them, or (per linear) its largest tensor."""
        if self.layout.fsdp_unit == "linear":
            return max(n for _, n in unit.params + unit.experts)
        return unit.numel + unit.expert_numel

    def stored(self, unit: Unit) -> int:
        """Parameter elements stored across steps: FSDP pads every dim-0 shard to ceil(rows / ranks)."""
        if not self.fsdp:
            return unit.numel + unit.expert_numel
        return _padded(unit.params, self.dense) + _padded(unit.experts, self.expert)

    def optimizer_numel(self, unit: Unit) -> int:
        """Elements the optimizer keeps state for: FSDP's unpadded shards, ZeRO-1's even slices."""
        if self.fsdp:
            return (unit.numel + self.dense - 1) // self.dense + unit.expert_numel // self.expert
        if self.layout.zero_stage == 1 and self.layout.dp_shard > 1:
            return sum(-(-n // self.layout.dp_shard) for _, n in unit.params + unit.experts)
        return unit.numel + unit.expert_numel

    def gathered_at_loss(
        self, blocks: list[tuple[Unit, int]], last_block: Unit | None, roots: list[Unit]
    ) -> int:
        """FSDP's unsharded parameters (compute dtype) alive while the loss's backward runs: the root's
        (gathered for the output projection's backward), the last block's all-gather prefetched for its
        backward (ZeRO-3), or every block still gathered since the forward (ZeRO-2 reshards a unit
        only after its backward). `blocks`: the stage's block units by kind, with their counts."""
        if not self.fsdp:
            return 0
        a = compute_bytes(self.layout)
        gathered = sum(u.numel + u.expert_numel for u in roots)
        if self.layout.zero_stage == 2:
            gathered += sum(n * (u.numel + u.expert_numel) for u, n in blocks)
        elif last_block is not None:
            gathered += self.piece(last_block)
        return gathered * a

    def backward_working_set(
        self, blocks: list[tuple[Unit, int]], last_block: Unit | None, roots: list[Unit], last: bool
    ) -> int:
        """What a block's backward adds to the saved activations: the output projection's gradient made
        before it (fp32; FSDP: unsharded until the root's reduce-scatter ends the backward) and, under
        FSDP, the root gathered, this block and the next one (prefetched) gathered, this block's
        unsharded gradients and the reduce-scatter's copy of them (per linear: of its largest tensor).
        `blocks` as in `gathered_at_loss`."""
        if last_block is None:
            return 0
        v_d = sum(n for rows, n in roots[-1].params if rows != self.layout_dim) if last else 0
        if not self.fsdp:
            return (v_d + last_block.numel + last_block.expert_numel) * FP32
        a = compute_bytes(self.layout)
        unit = max(self.piece(u) for u, _ in blocks)
        root = sum(u.numel + u.expert_numel for u in roots)
        gathered = root + (
            2 * unit
            if self.layout.zero_stage == 3
            else sum(n * (u.numel + u.expert_numel) for u, n in blocks)
        )
        return gathered * a + v_d * FP32 + 2 * unit * FP32

    def optimizer_transient(self, units: list[Unit], run: RunShape) -> tuple[int, str]:
        """The optimizer step's largest temporaries: torch's AdamW on the CPU steps one tensor at a time,
        with two fp32 temporaries of it (the square root of the second moment and its quotient); ZeRO-1
        then all-gathers each parameter whole (its padded slices, then the gathered copy)."""
        if run.optimizer == "sgd":
            return 0, "optimizer temporaries"
        sizes = [n for u in units for _, n in u.params + u.experts]
        if self.fsdp:
            largest = max(-(-n // self.dense) for n in sizes)
        elif self.layout.zero_stage == 1 and self.layout.dp_shard > 1:
            return 2 * max(sizes) * FP32, "ZeRO-1 parameter gather"
        else:
            largest = max(sizes)
        return 2 * largest * FP32, "AdamW temporaries"


def _padded(params: tuple[tuple[int, int], ...], ranks: int) -> int:
    return (
        sum(-(-rows // ranks) * (n // rows) for rows, n in params) if ranks > 1 else sum(n for _, n in params)
    )


def _size(n: int) -> str:
    """Bytes in GiB, or MiB below 0.1 GiB."""
    gib = 2**30
    return f"{n / gib:.1f} GiB" if n >= 0.1 * gib else f"{n / 2**20:.1f} MiB"
