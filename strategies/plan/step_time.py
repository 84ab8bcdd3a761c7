"""How long one optimizer step of a layout takes, from the model's shapes and the hardware's rates: the
compute of a rank (FLOPs per token over the device's achievable rate), each technique's collectives (their
bytes over the bus bandwidth of the link their group spans) and what of them the technique hides behind
compute. A model of a rank in the steady state, to rank layouts and to say which cost dominates; it
ignores kernel launch latencies and stragglers.

Collective times follow Hockney's model over nccl-tests' bus bandwidth: S bytes over n ranks take
alpha * steps + S * f / busbw, f = 2(n-1)/n for a ring all-reduce and (n-1)/n for an all-gather,
reduce-scatter or all-to-all (S the gathered size), steps the ring's 2(n-1) or n-1 (hardware.py): many small
collectives (tp's per block, FSDP's per block over many ranks) pay the fixed cost each time.

Compute runs each matmul at the rate the hardware gives a product of its arithmetic intensity (split
matmuls of tp, attention's per-head products: smaller, slower) times each rank's share of a host its
ranks compute on together (hardware.py's `matmul_rate` and `sharing`).

What overlaps, as the strategies run it:
- FSDP (zero 2/3) gathers block i+1 while block i computes and reduce-scatters in the backward: only
  what exceeds the compute, plus one block's worth at the ends, waits. Stage 3 gathers in the forward and
  again in the backward of every micro-batch; stage 2 once per micro-batch (once per step under a
  pipeline, whose stages keep parameters unsharded between micro-batches); gradients are reduce-scattered
  once per step (the last micro-batch's backward).
- DDP all-reduces buckets during the last micro-batch's backward; the last bucket waits. ZeRO-1 adds the
  all-gather of the updated parameters after the optimizer step, which nothing hides.
- What hides, hides only as far as `Hardware.overlap` says (all of it on GPUs; on a CPU host without a spare
  core, gloo's transfers run on the computing cores: nothing hides).
- Tensor, context and expert parallel collectives sit on the critical path of every block (not hidden);
  so does the host time of tensor parallelism and of FSDP on a CPU host (DTensor's bookkeeping, FSDP's
  hooks, per block and in the optimizer step, when the doctor measured it); on a GPU it hides behind the
  kernels it queues;
  the pipeline's bubble is (p-1)/m of a stage's work for GPipe and 1F1B, (p-1)/(v m) interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strategies.plan.compute import pass_seconds
from strategies.plan.hardware import Hardware
from strategies.plan.shapes import Layout, ModelShape, RunShape

WORLD_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # strategies/parallel_dims.py: pp outermost
DDP_BUCKET_BYTES = 25e6  # DistributedDataParallel's bucket_cap_mb default: the bucket that waits


@dataclass(frozen=True)
class StepTime:
    """One optimizer step of one rank: compute, each technique's communication (its whole time, and the
    part of it that the step waits for), the step, and what the world gets from it."""

    compute_s: float
    comm_s: dict[str, float] = field(default_factory=dict)  # technique -> seconds on the wire
    exposed_s: dict[str, float] = field(default_factory=dict)  # technique -> seconds the step waits
    step_s: float = 0.0
    tokens_per_step: int = 0  # over the whole world
    tokens_per_s: float = 0.0
    mfu: float = 0.0  # model FLOPs (no recompute) per second over the world's peak
    dominant: str = "compute"

    def line(self) -> str:
        """One line: the step, tokens/s, MFU and each cost that shows."""
        parts = [f"compute {self.compute_s:.3g}s"] + [
            f"{name} {seconds:.3g}s" for name, seconds in self.exposed_s.items() if seconds > 0
        ]
        return (
            f"step {self.step_s:.3g}s ({', '.join(parts)}), {self.tokens_per_s:,.0f} tokens/s, "
            f"MFU {self.mfu:.1%}, dominant: {self.dominant}"
        )


# ---- the model's sizes, from its shapes (the same counts as trainer/models/llama.py) ----------------------
def attention_params(shape: ModelShape) -> int:
    """wq, wk, wv, wo of one block."""
    return shape.dim * shape.head_dim * (2 * shape.n_heads + 2 * shape.n_kv_heads)


def expert_params(shape: ModelShape) -> int:
    """The routed experts' weights of the whole model (0 for a dense model)."""
    return shape.n_layers * shape.n_experts * 3 * shape.dim * shape.expert_ffn_dim


def dense_params(shape: ModelShape) -> int:
    """Every weight but the routed experts': blocks, router, shared experts, embedding and output."""
    if shape.n_experts:
        ffn = shape.dim * shape.n_experts + 3 * shape.dim * shape.expert_ffn_dim * shape.n_shared_experts
    else:
        ffn = 3 * shape.dim * shape.ffn_dim
    norms = shape.n_layers * 2 * shape.dim + shape.dim
    embeddings = shape.vocab_size * shape.dim * (1 if shape.tie_embeddings else 2)
    return shape.n_layers * (attention_params(shape) + ffn) + embeddings + norms


def linears_per_block(shape: ModelShape) -> int:
    """Weight tensors of a block (wq, wk, wv, wo and the feed-forward's: a dense SwiGLU's three, a MoE's
    router, shared experts' three and routed experts' three stacked ones); the norms aside."""
    if not shape.n_experts:
        return 7
    return 4 + 1 + 3 + (3 if shape.n_shared_experts else 0)


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's 6N + 12 L H hd T as `Llama.flops_per_token`: N the matmul weights a
    token passes through (top_k routed and the shared experts of a MoE block; the output projection even
    when tied), the second term attention's QK^T and AV over the full T x T scores."""
    if shape.n_experts:
        ffn = shape.dim * shape.n_experts + 3 * shape.dim * shape.expert_ffn_dim * (
            shape.top_k + shape.n_shared_experts
        )
    else:
        ffn = 3 * shape.dim * shape.ffn_dim
    n_matmul = shape.n_layers * (attention_params(shape) + ffn) + shape.dim * shape.vocab_size
    return 6 * n_matmul + 12 * shape.n_layers * shape.n_heads * shape.head_dim * seq_len


def recompute_flops_per_token(shape: ModelShape, seq_len: int, mode: str) -> float:
    """What activation checkpointing adds: full recomputes each block's forward (a third of its 6N + 12LHhdT),
    selective only attention's score products (a third of 12 L H hd T), TorchTitan's op policy (dense
    blocks) the forward of wk, wo and w3."""
    attention = 12 * shape.n_layers * shape.n_heads * shape.head_dim * seq_len
    if mode == "full":
        return (flops_per_token(shape, seq_len) - 6 * shape.dim * shape.vocab_size) / 3
    if mode == "selective":
        return attention / 3
    if mode == "selective_op":
        widths = shape.head_dim * (shape.n_kv_heads + shape.n_heads) + shape.ffn_dim  # wk, wo, w3
        return 2 * shape.n_layers * shape.dim * widths
    return 0.0


# ---- which link a group spans ------------------------------------------------------------------------
def _stride(layout: Layout, dim: str) -> int:
    inner = WORLD_DIMS[WORLD_DIMS.index(dim) + 1 :]
    stride = 1
    for d in inner:
        stride *= getattr(layout, d)
    return stride


def crosses_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether a group of `size` ranks `stride` apart leaves a node of `gpus_per_node` consecutive ranks
    (its ring then runs at the inter-node rate: the slowest hop sets a ring's pace)."""
    return stride * size > gpus_per_node


def _seconds(hw: Hardware, op: str, group: str, nbytes: float, n: int, inter: bool) -> float:
    """One collective of `nbytes` (the full buffer: all-reduce's, the gathered all-gather's) over `n` ranks."""
    return hw.collective_s(op, group, nbytes, n, inter)


def _wait(comm: float, window: float, overlap: float) -> float:
    """What of `comm` seconds the step waits for when `window` seconds of compute could hide it and the
    hardware hides a share `overlap` of what fits."""
    return comm - overlap * min(comm, max(window, 0.0))


def _intensity_size(m: float, k: float, n: float) -> float:
    """The n of an n x n x n product as arithmetic-intense (FLOPs per element moved) as an m x k by k x n
    one: 3 / (1/m + 1/k + 1/n). A product's backward (its transposes) has the same."""
    return 3.0 / (1.0 / m + 1.0 / k + 1.0 / n)


def weight_matmuls(
    shape: ModelShape, layout: Layout, tokens: float
) -> list[tuple[float, float, float, float]]:
    """(FLOPs, m, k, n) of the weight matmuls of one rank's pass over `tokens` tokens, forward and backward
    (6 per weight and token), each a (tokens x dim) by (dim x width) product: each block's (tp splits each
    weight's heads or hidden width), every block together, the output layer last."""
    tp, d, T = layout.tp, shape.dim, tokens
    q, kv = shape.n_heads * shape.head_dim / tp, shape.n_kv_heads * shape.head_dim / tp
    if shape.n_experts:  # the router, each routed expert on its share of the tokens, the shared experts
        f, routed = shape.expert_ffn_dim / tp, T * shape.top_k / shape.n_experts
        ffn = [(d * shape.n_experts, T, shape.n_experts)]
        ffn.append((3 * d * f * shape.top_k, routed, f))
        if shape.n_shared_experts:
            ffn.append((3 * d * f * shape.n_shared_experts, T, f))
    else:
        f = shape.ffn_dim / tp
        ffn = [(3 * d * f, T, f)]
    block = [(2 * d * q, T, q), (2 * d * kv, T, kv), *ffn]
    found = [(6 * w * T * shape.n_layers, m, d, n) for w, m, n in block]
    vocab = shape.vocab_size / tp
    found.append((6 * d * vocab * T, T, d, vocab))
    return found


def matmuls(shape: ModelShape, layout: Layout, tokens: float, seq_len: int) -> list[tuple[float, float]]:
    """(FLOPs, intensity size) of the matmuls of one rank's pass over `tokens` tokens of sequences of
    `seq_len`, forward and backward, as `flops_per_token` counts them: the weights' (`weight_matmuls`) and
    attention's scores (12 L H hd T; cp splits each sequence's queries)."""
    q = shape.n_heads * shape.head_dim / layout.tp
    scores = 12 * shape.n_layers * q * seq_len * tokens
    queries = seq_len / layout.cp
    weights = [(f, _intensity_size(m, k, n)) for f, m, k, n in weight_matmuls(shape, layout, tokens)]
    return [*weights, (scores, _intensity_size(queries, shape.head_dim, seq_len))]


def matmul_rate(shape: ModelShape, layout: Layout, tokens: float, seq_len: int, hw: Hardware) -> float:
    """One rank's FLOP/s over its pass's matmuls: their FLOPs over the time each takes at its size's rate."""
    found = matmuls(shape, layout, tokens, seq_len)
    return sum(f for f, _ in found) / sum(f / hw.matmul_rate(n) for f, n in found)


def _sharded_host(
    hosts: dict[str, float], kind: str, hw: Hardware, L: Layout, micro: int, blocks: float
) -> None:
    """`kind` sharding's host time of a step into `hosts` (DTensor's dispatch and bookkeeping, tp's
    styles, FSDP's hooks and copies) as the doctor measured it per block pass (again for the forward a full
    recompute reruns) and per model pass, and once a step in the optimizer step and the clip over the
    DTensor parameters; nothing when the doctor did not measure it."""
    found = hw.rates.sharded.get(kind) if hw.rates is not None else None
    if not found:
        return
    rerun = 4 / 3 if L.activation_checkpointing == "full" else 1.0
    host = micro * (found.get("block_s", 0.0) * blocks * rerun + found.get("pass_s", 0.0))
    hosts[kind] = host + found.get("step_block_s", 0.0) * blocks + found.get("step_s", 0.0)


def _host_waits(hosts: dict[str, float], hw: Hardware, compute: float) -> dict[str, float]:
    """What of the shardings' host time the step waits for: a CPU host spends all of it inside the step; a
    GPU's host queues the kernels meanwhile, so only what all of it together exceeds them by shows (shared
    in proportion)."""
    if hw.rates is None or hw.rates.host_cores is not None:
        return {f"{kind} host": s for kind, s in hosts.items()}
    total = sum(hosts.values())
    shown = max(total - compute, 0.0)
    return {f"{kind} host": s / total * shown if total else 0.0 for kind, s in hosts.items()}


def step_time(shape: ModelShape, layout: Layout, run: RunShape, hardware: Hardware) -> StepTime:
    """The predicted time of one optimizer step of `layout` on `hardware` (see the module's docstring)."""
    hw, L = hardware, layout
    gpn = hw.gpus_per_node
    pp, tp, cp, ep = L.pp, L.tp, L.cp, L.ep
    dp = L.dp_replicate * L.dp_shard
    # run.micro_batch is the batch of one accumulation step per data-parallel rank; a pipeline cuts it into
    # pp_microbatches micro-batches (as Parallel3DStrategy's `microbatches` does the loader's batch)
    cuts = L.pp_microbatches if pp > 1 else 1
    micro = run.accumulation * cuts  # forward-backward passes a rank runs per step
    seqs = run.micro_batch / cuts  # sequences of each pass
    tokens_replica = run.micro_batch * run.seq_len * run.accumulation  # one data-parallel rank's, per step
    act_bytes = 2 if L.precision == "bf16" else 4
    param_bytes = 2 if L.precision == "bf16" else 4  # what FSDP gathers: its compute dtype
    grad_bytes = 4  # reduced in fp32 (reduce_dtype) under bf16-mixed, and in fp32 under fp32
    blocks = shape.n_layers / pp  # this rank's, of every micro-batch

    # compute: this rank's share of its replica's tokens (tp, cp split each token's work; pp its blocks)
    fpt = flops_per_token(shape, run.seq_len)
    work = fpt + recompute_flops_per_token(shape, run.seq_len, L.activation_checkpointing)
    on_host = min(L.world, gpn)  # ranks that share one host
    if hw.rates is None and hw.device.hbm_GBps:  # a GPU of the table: the physical model (compute.py)
        pass_tokens = seqs * run.seq_len / cp
        one = pass_seconds(weight_matmuls(shape, L, pass_tokens), shape, L, pass_tokens, run.seq_len, hw)
        alone = one * micro / pp / (hw.device.fp32_ratio if L.precision == "fp32" else 1.0)
    else:  # measured rates, or a CPU process: the FLOPs at the measured (or flat) rate of their sizes
        rate = matmul_rate(shape, L, seqs * run.seq_len / cp, run.seq_len, hw)
        rate *= hw.device.fp32_ratio if L.precision == "fp32" and hw.rates is None else 1.0
        alone = tokens_replica * work / (tp * pp * cp) / rate  # this rank's compute with the host to itself
    # a pipeline's bubble is (p-1)/(v m) of a stage's work; while the other stages fill and drain a rank
    # computes with fewer neighbours: that share of its work runs at the rate of a rank alone (exact for
    # two stages, where one rank idles exactly while the other works alone)
    bubble = (pp - 1) / (L.stages_per_rank * L.pp_microbatches) if pp > 1 else 0.0
    bubble = min(bubble, 1.0)
    compute = alone * bubble + alone * (1 - bubble) / hw.sharing(on_host)
    overlap = hw.overlap(on_host)
    backward_share = (2 + (1 if L.activation_checkpointing == "full" else 0)) / (
        3 + (1 if L.activation_checkpointing == "full" else 0)
    )

    comm: dict[str, float] = {}
    exposed: dict[str, float] = {}
    hosts: dict[str, float] = {}  # each sharding's host time (_sharded_host)
    # tensor parallel: 2 all-reduces (SP: reduce-scatter + all-gather, the same bytes) per block in the
    # forward, 2 in the backward, 2 more when full AC reruns the forward; on every block's critical path
    if tp > 1:
        inter = crosses_nodes(1, tp, gpn)
        tokens = seqs * run.seq_len / cp
        s = tokens * shape.dim * act_bytes
        if L.sequence_parallel:
            one = _seconds(hw, "reduce_scatter", "tp", s, tp, inter) + _seconds(
                hw, "all_gather", "tp", s, tp, inter
            )
        else:
            one = _seconds(hw, "all_reduce", "tp", s, tp, inter)
        per_block = 4 + (2 if L.activation_checkpointing == "full" else 0)
        # outside the blocks, per pass: the embedding's output (reduce-scattered into the sequence shards,
        # all-gathered back in the backward) and the output layer's input (the reverse); a pipeline's
        # slowest stage holds one of the two
        outside = 2 if pp == 1 else 1
        comm["tp"] = exposed["tp"] = one * (per_block * blocks + outside) * micro
        _sharded_host(hosts, "tp", hw, L, micro, blocks)
    # context parallel: each block all-gathers K and V of the whole sequence (again in the backward and in a
    # recompute) and reduce-scatters their gradients
    if cp > 1:
        inter = crosses_nodes(_stride(L, "cp"), cp, gpn)
        kv = 2 * seqs * run.seq_len * shape.n_kv_heads * shape.head_dim * act_bytes / tp
        gathers = 2 + (1 if L.activation_checkpointing == "full" else 0)
        one = gathers * _seconds(hw, "all_gather", "cp", kv, cp, inter) + _seconds(
            hw, "reduce_scatter", "cp", kv, cp, inter
        )
        comm["cp"] = exposed["cp"] = one * blocks * micro
    # expert parallel: dispatch and combine all-to-alls of each routed token's top_k copies, in the forward,
    # the backward and a full recompute
    if ep > 1 and shape.n_experts:
        inter = crosses_nodes(1, ep, gpn)  # the ep ranks are the innermost of dp_shard x cp x tp
        tokens = seqs * run.seq_len / (cp * tp)
        s = tokens * shape.top_k * shape.dim * act_bytes
        per_block = 4 + (2 if L.activation_checkpointing == "full" else 0)
        comm["ep"] = exposed["ep"] = (
            per_block * _seconds(hw, "all_to_all", "ep", s * ep, ep, inter) * blocks * micro
        )

    # data parallel over what is left
    dense_rank = dense_params(shape) / (tp * pp)
    expert_rank = expert_params(shape) / (pp * ep)
    shard = L.dp_shard * cp  # FSDP shards over the "dense" view: dp_shard x cp
    if L.dp_shard > 1 or (cp > 1 and L.zero_stage >= 2):
        inter = crosses_nodes(_stride(L, "cp") if cp > 1 else _stride(L, "dp_shard"), shard, gpn)
        params = dense_rank + expert_rank  # experts shard over the expert mesh: about the same ranks
        if L.zero_stage == 1:
            reduce = _seconds(hw, "all_reduce", "dense", params * grad_bytes, shard, inter)
            gather = _seconds(
                hw, "all_gather", "dense", params * 4, shard, inter
            )  # fp32 slices after the step
            comm["zero1"] = reduce + gather
            last_backward = compute * backward_share / micro
            exposed["zero1"] = _wait(reduce, last_backward, overlap) + gather
        else:
            # per block and micro-batch: the forward gathers it (stage 2: only the micro-batches that find
            # it resharded), the backward gathers it again (stage 3) and, in the step's last micro-batch,
            # reduce-scatters its gradients; block i+1's transfer hides behind block i's compute
            unit = params / max(blocks, 1)
            # per linear (DeepSpeed's ZeRO-3): the same bytes in a collective per weight tensor
            pieces = linears_per_block(shape) if L.fsdp_unit == "linear" else 1
            gather = pieces * _seconds(hw, "all_gather", "dense", unit * param_bytes / pieces, shard, inter)
            reduce = pieces * _seconds(
                hw, "reduce_scatter", "dense", unit * grad_bytes / pieces, shard, inter
            )
            if L.dp_replicate > 1:  # HSDP: the shards' gradients all-reduced over the replicas
                inter_r = crosses_nodes(_stride(L, "dp_replicate"), L.dp_replicate, gpn)
                reduce += _seconds(
                    hw, "all_reduce", "dp_replicate", unit * grad_bytes / shard, L.dp_replicate, inter_r
                )
            forward_gathers = micro if L.zero_stage == 3 or pp == 1 else 1
            backward_gathers = micro if L.zero_stage == 3 else 0
            fwd_block = compute * (1 - backward_share) / (micro * max(blocks, 1))
            bwd_block = compute * backward_share / (micro * max(blocks, 1))
            waits = blocks * (
                forward_gathers * _wait(gather, fwd_block, overlap)
                + max(0, backward_gathers - 1) * _wait(gather, bwd_block, overlap)
                + _wait(reduce + (gather if backward_gathers else 0.0), bwd_block, overlap)
            )
            comm["fsdp"] = blocks * (gather * (forward_gathers + backward_gathers) + reduce)
            # the first gather and the last reduce-scatter have no compute to hide behind (counted as
            # hidden in `waits` where anything hides)
            exposed["fsdp"] = waits + overlap * (gather + reduce)
            _sharded_host(hosts, "fsdp", hw, L, micro, blocks)
    elif L.dp_replicate > 1:  # DDP: one all-reduce of the gradients, in buckets during the last backward
        inter = crosses_nodes(_stride(L, "dp_replicate"), L.dp_replicate, gpn)
        size = (dense_rank + expert_rank) * grad_bytes  # DDP keeps fp32 parameters and gradients
        reduce = _seconds(hw, "all_reduce", "dp_replicate", size, L.dp_replicate, inter)
        bucket = _seconds(
            hw, "all_reduce", "dp_replicate", min(size, DDP_BUCKET_BYTES), L.dp_replicate, inter
        )
        comm["ddp"] = reduce
        last_backward = compute * backward_share / micro
        exposed["ddp"] = _wait(reduce, last_backward, overlap) + overlap * min(bucket, reduce)

    exposed.update(_host_waits(hosts, hw, compute))
    # pipeline: the bubble idles a stage for (p-1)/(v m) of its work; activations cross each boundary
    if pp > 1:
        v = L.stages_per_rank
        busy = alone + sum(exposed.get(k, 0.0) for k in ("tp", "tp host", "cp", "ep"))
        exposed["pp bubble"] = busy * (pp - 1) / (v * L.pp_microbatches)
        inter = crosses_nodes(_stride(L, "pp"), pp, gpn)
        s = seqs * run.seq_len / cp * shape.dim * act_bytes / (tp if L.sequence_parallel else 1)
        # a send of s bytes to the next stage moves what a 2-rank all-gather of 2s does, latency included
        send = _seconds(hw, "all_gather", "pp", 2 * s, 2, inter)
        comm["pp p2p"] = exposed["pp p2p"] = 2 * v * micro * send  # an activation forward, its gradient back

    step = compute + sum(exposed.values())
    tokens = tokens_replica * dp
    peak = hw.peak_flops_per_s
    world = L.world
    costs = {"compute": compute, **exposed}
    return StepTime(
        compute_s=compute,
        comm_s=comm,
        exposed_s=exposed,
        step_s=step,
        tokens_per_step=int(tokens),
        tokens_per_s=tokens / step,
        mfu=tokens / step * fpt / (world * peak),
        dominant=max(costs, key=costs.get),
    )
