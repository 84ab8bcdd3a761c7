"""The tensors one rank of a layout holds, counted from a ModelShape as the model and the strategies make
them: the parameters of each FSDP unit (trainer/models/llama.py, moe.py; cut by the pipeline, split by
the tensor-parallel plan, experts by expert parallelism) and the bytes a block's forward saves for its
backward (what autograd keeps of each op in the Llama's forward, under each activation-checkpointing mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strategies.plan.shapes import Layout, ModelShape


@dataclass(frozen=True)
class Unit:
    """A group of parameters that FSDP gathers and frees together (a block, or the root: what is left):
    `rows` (dim 0, which FSDP shards) and elements of each, as this rank holds them before FSDP."""

    name: str
    params: tuple[tuple[int, int], ...]  # (dim 0, elements) per parameter
    experts: tuple[tuple[int, int], ...] = ()  # routed experts: their own FSDP unit over the expert mesh
    cast: int = 0  # elements bf16 autocast copies (matmul weights, experts included): not norms, not lookups
    # their sums, set once: the planner reads them ~10^5-10^6 times a search (a cached_property's lock cost
    # ~10% of `trainer plan`'s time)
    numel: int = field(init=False, repr=False, compare=False)
    expert_numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", sum(n for _, n in self.params))
        object.__setattr__(self, "expert_numel", sum(n for _, n in self.experts))


def is_moe_layer(shape: ModelShape, layer: int) -> bool:
    """Block `layer` has a MoE feed-forward (MoEConfig.is_moe_layer's rule)."""
    return (
        shape.n_experts > 0
        and layer >= shape.n_dense_layers
        and ((layer - shape.n_dense_layers) % shape.moe_every == 0)
    )


def block_unit(shape: ModelShape, layout: Layout, layer: int) -> Unit:
    """Block `layer`'s parameters on one rank: attention and dense SwiGLU split over tp (wq/wk/wv/w1/w3
    by rows, wo/w2 by columns), norms whole; a MoE feed-forward's router and shared experts whole on every
    tp rank (llama_tp_plan's ETP=1), its routed experts E/ep each."""
    t, d, hd = layout.tp, shape.dim, shape.head_dim
    q_rows, kv_rows = shape.n_heads * hd // t, shape.n_kv_heads * hd // t
    params = [(d, d), (d, d)]  # attention_norm, ffn_norm
    params += [(q_rows, q_rows * d), (kv_rows, kv_rows * d), (kv_rows, kv_rows * d), (d, d * q_rows)]
    if not is_moe_layer(shape, layer):
        f = shape.ffn_dim // t
        params += [(f, f * d), (f, f * d), (d, d * f)]
        return Unit(f"layers.{layer}", tuple(params), cast=sum(n for _, n in params[2:]))
    e, fe = shape.n_experts, shape.expert_ffn_dim
    params.append((e, e * d))  # router gate
    shared = shape.n_shared_experts * fe
    if shared:
        params += [(shared, shared * d), (shared, shared * d), (d, d * shared)]
    local = e // layout.ep
    experts = ((local, local * d * fe),) * 3  # w1, w3 (E, dim, ffn), w2 (E, ffn, dim)
    return Unit(f"layers.{layer}", tuple(params), experts, sum(n for _, n in params[2:]) + 3 * local * d * fe)


def root_unit(shape: ModelShape, layout: Layout, first: bool, last: bool) -> Unit:
    """What FSDP's root unit of a stage holds: the embedding (first stage), the final norm and the output
    projection (last stage), vocabulary-split over tp; a tied output is the embedding's tensor."""
    v, d = shape.vocab_size // layout.tp, shape.dim
    params: list[tuple[int, int]] = []
    if first:
        params.append((v, v * d))
    if last:
        params.append((d, d))
        if not (shape.tie_embeddings and first):
            params.append((v, v * d))
    return Unit("root", tuple(params), cast=v * d if last else 0)


# Bytes of an fp32 element: the norms' statistics, and the residual stream outside FSDP (under bf16 autocast
# the embedding is not autocast, and fp32 + bf16 adds to fp32).
FP32 = 4


def compute_bytes(layout: Layout) -> int:
    """Bytes of a matmul's inputs and outputs: bf16 under bf16-mixed, else fp32."""
    return 2 if layout.precision == "bf16" else FP32


def runs_fsdp(layout: Layout) -> bool:
    """ParallelStrategy runs FSDP (ZeRO 2/3) whenever a mesh dimension beyond dp_replicate is used; plain
    replicas (dp_shard 1 and nothing else) and ZeRO-1 are DDP."""
    others = layout.tp * layout.pp * layout.cp * layout.ep
    return layout.zero_stage >= 2 and (layout.dp_shard > 1 or others > 1)


def stream_bytes(layout: Layout) -> int:
    """Bytes of a residual-stream element between and inside the blocks: bf16 under FSDP's bf16 mixed
    precision (it gathers bf16 parameters and casts each block's inputs; no autocast runs:
    strategies/parallel.py), fp32 otherwise."""
    return 2 if layout.precision == "bf16" and runs_fsdp(layout) else FP32


def block_saved_bytes(shape: ModelShape, layout: Layout, layer: int, tokens: int) -> int:
    """What block `layer`'s forward over `tokens` tokens (this rank's, before tp) keeps for its backward
    without activation checkpointing (measured with saved_tensors_hooks on the CPU, one storage counted once).
    Per RMSNorm: its input in fp32 (the fp32 stream itself, or under FSDP's bf16 its fp32 upcast) and its
    normalised value (in the stream's dtype); its output once, in the compute dtype, which every linear
    reading it shares (trainer/models/shared_cast.py; a MoE's router reads the norm's output as it is).
    Attention: the rotated q, k, the v, the kernel's output (also wo's input: the kernel lays it out so that
    the transpose back is a view) and log-sum-exp. SwiGLU: w1 and w3 outputs, silu's output and the product.
    Under tp every part inside the attention and the MLP is split; with sequence parallelism the norms run on
    sequence shards, and the projections keep the shard of the gathered sequence they read
    (trainer/models/sequence_gather.py), but not where autocast casts it after the gather (they keep
    its cast of the whole sequence) nor in a checkpointed block's recompute. Context parallel: each
    attention keeps the K/V all-gathered over the cp ranks (strategies/techniques/cp/attention.py), cp
    times its own."""
    a, s, t, d = compute_bytes(layout), stream_bytes(layout), layout.tp, shape.dim
    sp = t if layout.sequence_parallel else 1
    gathered = sp if a == s and layout.activation_checkpointing == "none" else 1  # kept as the shard
    dq, dkv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    moe = is_moe_layer(shape, layer)
    # the attention's q/k/v read the attention norm's output; the MLP's w1/w3 (MoE: the router) the ffn norm's
    norm_outputs = a * d / gathered + (s * d if moe else a * d / gathered)
    per_token = 2 * (FP32 + s) * d / sp + norm_outputs
    per_token += ((2 * dq + 2 * dkv) * a + shape.n_heads * FP32) / t  # q, k, v, out; lse
    if layout.cp > 1:  # context parallel: the kernel keeps the gathered K/V of the whole sequence instead
        per_token += (2 * dkv * a * layout.cp) / t  # (this rank's stacked K/V too: the gather's input)
    if not moe:
        per_token += 4 * shape.ffn_dim * a / t
    else:
        per_token += _moe_saved_per_token(shape, layout)
    return int(tokens * per_token)


def _moe_saved_per_token(shape: ModelShape, layout: Layout) -> float:
    """A MoE feed-forward, per token it routes (dropless: top_k pairs each; capacity keeps fewer): the
    router's logits and scores (fp32), each pair's rows three times (gathered for the experts, their
    output, gated) and its int64 ids three times (choice, sort order, token), the routed SwiGLU's four
    tensors per pair, the shared experts' four per token. Under tp each rank routes its sequence shard;
    expert parallelism moves the pairs but keeps as many per rank on average."""
    a, e, fe, k = compute_bytes(layout), shape.n_experts, shape.expert_ffn_dim, shape.top_k
    pairs = k if shape.capacity_factor is None else min(k, k * shape.capacity_factor)
    routed = pairs * (3 * shape.dim * a + 4 * fe * a + 3 * 8)
    shared = 4 * shape.n_shared_experts * fe * a
    return (2 * e * FP32 + routed + shared) / layout.tp


def block_matmul_widths(shape: ModelShape) -> list[int]:
    """The output width of each weight matmul of a dense block, in the order its forward runs them: wq, wk,
    wv, wo, then SwiGLU's w1, w3 and w2 (trainer/models/llama.py; TorchTitan's Llama the same)."""
    dq, dkv, f = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim, shape.ffn_dim
    return [dq, dkv, dkv, shape.dim, f, f, shape.dim]


def block_checkpointed_bytes(shape: ModelShape, layout: Layout, layer: int, tokens: int) -> int:
    """What a checkpointed block keeps until its backward. "full": its input (the residual stream,
    sequence-split under sp). "selective" (strategies/techniques/activation_checkpointing.py): also the outputs of
    every matmul and of the attention kernel, in the compute dtype; the rest is recomputed. "selective_op"
    (TorchTitan's, a dense block only): the same but every second matmul's output (wk, wo, w3: recomputed)."""
    sp = layout.tp if layout.sequence_parallel else 1
    kept = tokens * shape.dim * stream_bytes(layout) / sp
    if layout.activation_checkpointing == "full":
        return int(kept)
    a, t, d = compute_bytes(layout), layout.tp, shape.dim
    attention = (shape.n_heads * shape.head_dim * a + shape.n_heads * FP32) / t  # the kernel's output, lse
    if layout.activation_checkpointing == "selective_op":
        return int(kept + tokens * (sum(block_matmul_widths(shape)[::2]) * a / t + attention))
    dq, dkv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    matmuls = (dq + 2 * dkv + d) * a / t + attention  # q k v wo; attention
    if is_moe_layer(shape, layer):
        fe, k = shape.expert_ffn_dim, shape.top_k
        matmuls += (shape.n_experts * FP32 + k * (2 * fe + d) * a + shape.n_shared_experts * 3 * fe * a) / t
    else:
        matmuls += (2 * shape.ffn_dim + d) * a / t  # w1, w3, w2
    return int(kept + tokens * matmuls)
