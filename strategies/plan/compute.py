"""The physical compute time of one rank's pass on a GPU of the device table: each weight matmul at the rate
its shape reaches (`Device.gemm_rate`: the roofline times the GEMM efficiency curve, so tp's and cp's smaller
products run slower), attention as flash attention runs it (the causal half of the score products, the
backward's recompute of the scores, at flash attention's own share of the peak, lower on short blocks), and
the memory-bound work between the matmuls (norms, residual adds, SwiGLU's gate, rotary embeddings, the loss's
softmax) as the bytes it moves over the HBM bandwidth: fused kernels pass over each tensor about once,
eager PyTorch about three times (a kernel per op, fp32 upcasts in the norms).

No constant is fitted to a paper or a model: the rates come from datasheets and published kernel benchmarks
(strategies/plan/hardware.py), the byte counts from the ops' shapes."""

from __future__ import annotations

from strategies.plan.hardware import GB, Hardware
from strategies.plan.shapes import Layout, ModelShape

# flash attention's FLOPs as run, over the 12 L H hd T the MFU counts: the causal mask skips half the score
# blocks, and the backward recomputes the scores (FlashAttention-2's backward: 5 products to the forward's 2,
# so 3.5 forward-units where the count has 3)
CAUSAL_SHARE = 0.5
FLASH_BACKWARD = 3.5 / 3
# flash attention reaches its share of the peak on long blocks; a block of n queries/keys gets n / (n + 256)
# of it (FlashAttention-2's figures: at 512 tokens about two thirds of its 16K-token rate)
ATTENTION_HALF_BLOCK = 256
# the HBM bandwidth a streaming kernel reaches: ~92% of the datasheet's (STREAM triad / device copies on H100:
# ~3.09 of 3.35 TB/s)
HBM_ACHIEVED = 0.9
# passes over a tensor's bytes an eager op sequence makes against one fused kernel (RMSNorm in eager PyTorch:
# upcast, square, mean, rsqrt, two multiplies and a downcast, where a fused kernel reads and writes once)
EAGER_PASSES = 3.0


def elementwise_bytes(shape: ModelShape, layout: Layout, tokens: float) -> float:
    """HBM bytes the memory-bound ops of one pass (forward and backward) over `tokens` tokens of this rank
    move, with fused kernels (x EAGER_PASSES in eager): per block two norms with their residual adds (read and
    write d in the forward, read 2d and write d in the backward: 10 d bytes each in bf16), SwiGLU's gate (16 f:
    two inputs and one output forward, three and two backward), rotary on q and k (8 bytes per element), and the
    loss's softmax over the vocabulary in fp32 (8 V). tp splits what it shards; sequence parallel the norms."""
    tp = layout.tp
    q = shape.n_heads * shape.head_dim / tp
    kv = shape.n_kv_heads * shape.head_dim / tp
    ffn = (
        shape.expert_ffn_dim * (shape.top_k + shape.n_shared_experts) if shape.n_experts else shape.ffn_dim
    ) / tp
    norms = 2 * 10 * shape.dim / (tp if layout.sequence_parallel else 1)
    block = norms + 16 * ffn + 8 * (q + kv)
    # the recomputed forward: every checkpointing mode reruns the block's elementwise ops
    rerun = 4 / 3 if layout.activation_checkpointing != "none" else 1.0
    loss = 8 * shape.vocab_size / tp
    passes = 1.0 if layout.fused_kernels else EAGER_PASSES
    return passes * tokens * (shape.n_layers * block * rerun + loss)


def attention_s(shape: ModelShape, layout: Layout, tokens: float, seq_len: int, hw: Hardware) -> float:
    """Seconds of attention over `tokens` query tokens of this rank (all blocks, forward and backward, and
    the forward again when checkpointing recomputes it): flash attention's, or `unfused_attention_s`."""
    counted = 12 * shape.n_layers * shape.n_heads * shape.head_dim / layout.tp * seq_len * tokens
    if not layout.flash_attention:
        return unfused_attention_s(shape, layout, counted, tokens, seq_len, hw)
    # the backward recomputes the forward's kernel unless its output was kept (TorchTitan's op policy keeps it)
    rerun = (3.5 + 1) / 3.5 if layout.activation_checkpointing in ("selective", "full") else 1.0
    block = seq_len / layout.cp  # ring attention's blocks: a cp shard's queries against one shard of keys
    rate = hw.device.sustained_flops * hw.device.attention_efficiency * block / (block + ATTENTION_HALF_BLOCK)
    return counted * CAUSAL_SHARE * FLASH_BACKWARD * rerun / rate


def unfused_attention_s(
    shape: ModelShape, layout: Layout, counted: float, tokens: float, seq_len: int, hw: Hardware
) -> float:
    """Attention that materializes its scores (before FlashAttention, Megatron-LM 2021): QK^T and AV as
    batched GEMMs of a head's (queries x head_dim x keys), every score computed (the mask applied after),
    and the score matrix through HBM: written by QK^T, read and written by the softmax (scale and mask
    fused), read by AV in the forward (8 bytes a score in bf16), twice that in the backward (16); the forward
    again under recompute."""
    rerun = 4 / 3 if layout.activation_checkpointing != "none" else 1.0
    queries = seq_len / layout.cp
    n = _intensity(queries, shape.head_dim, seq_len)
    heads = shape.n_heads / layout.tp * tokens / queries  # the batch: every head of every sequence shard
    fill = (heads * queries * shape.head_dim * seq_len) ** (1 / 3)
    scores = shape.n_layers * shape.n_heads / layout.tp * seq_len * tokens  # score elements of this rank
    hbm = hw.device.hbm_GBps * GB * HBM_ACHIEVED
    return counted * rerun / hw.device.gemm_rate(n, fill) + scores * (8 * rerun + 16) / hbm


def _intensity(m: float, k: float, n: float) -> float:
    """The n of an n x n x n product as arithmetic-intense as an m x k by k x n one (step_time's)."""
    return 3.0 / (1.0 / m + 1.0 / k + 1.0 / n)


def pass_seconds(
    weight_matmuls: list[tuple[float, float, float, float]],
    shape: ModelShape,
    layout: Layout,
    tokens: float,
    seq_len: int,
    hw: Hardware,
) -> float:
    """Seconds of one rank's forward-backward pass over `tokens` tokens (every block, before a pipeline
    divides them): its weight matmuls ((FLOPs, m, k, n), each at the rate its intensity and its work give:
    `Device.gemm_rate`; again for the share of its forward a recompute reruns: `recomputed_forward`),
    attention, and the memory-bound ops."""
    times = [
        f / hw.device.gemm_rate(_intensity(m, k, n), (m * k * n) ** (1 / 3)) for f, m, k, n in weight_matmuls
    ]
    rerun = recomputed_forward(layout, len(times))
    matmul = sum(t * (1 + share / 3) for t, share in zip(times, rerun, strict=True))  # a forward: 2 of 6
    memory = elementwise_bytes(shape, layout, tokens) / (hw.device.hbm_GBps * GB * HBM_ACHIEVED)
    return matmul + attention_s(shape, layout, tokens, seq_len, hw) + memory


def recomputed_forward(layout: Layout, entries: int) -> list[float]:
    """The share of the forward of each of `step_time.weight_matmuls`' `entries` (a dense block's: wq and
    wo, wk and wv, the feed-forward's three; the output layer last) that the backward runs again, by FLOPs:
    a full recompute every block's; TorchTitan's op policy every second matmul's (wk, wo, w3, in
    `tensors.block_matmul_widths`' order: half of the first two entries, a third of the feed-forward);
    the project's selective none (it keeps every matmul's output)."""
    if layout.activation_checkpointing == "full":
        return [1.0] * (entries - 1) + [0.0]
    if layout.activation_checkpointing == "selective_op":
        if entries != 4:
            raise ValueError("activation_checkpointing='selective_op' with experts; allowed: a dense model")
        return [1 / 2, 1 / 2, 1 / 3, 0.0]
    return [0.0] * entries
