"""The memory model's activations per block (strategies/plan/tensors.py) against Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198), Section 4.1: a GPT
layer keeps s*b*h*(34 + 5*a*s/h) bytes in 16-bit, s*b*h*34 when the attention kernel keeps no s x s
matrix (flash), and 1/t of it under tensor + sequence parallelism (their equation 5). Their count, op by
op, is redone here for this project's Llama block (RMSNorm, GQA, SwiGLU, no dropout); each term says what
it replaces, so the project's constant can be read beside their 34.
"""

from __future__ import annotations

import dataclasses

import pytest

from strategies.plan.memory import per_rank_memory
from strategies.plan.shapes import Layout, ModelShape, RunShape
from strategies.plan.tensors import block_saved_bytes

# (h, heads, kv heads, ffn): Llama 3 405B, 70B and 8B (Meta's params.json widths), and a small one
SHAPES = {
    "405b": ModelShape(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248),
    "70b": ModelShape(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "8b": ModelShape(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "small": ModelShape(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384),
}
# bf16: FSDP's mixed precision (bf16 stream), DDP's autocast (fp32 stream), and tp 8 with sequence parallel
LAYOUTS = {
    "fsdp": Layout(dp_shard=8, precision="bf16"),
    "ddp autocast": Layout(dp_replicate=8, precision="bf16"),
    "tp8": Layout(tp=8, dp_shard=8, precision="bf16"),
    "tp8 sp": Layout(tp=8, dp_shard=8, sequence_parallel=True, precision="bf16"),
    "tp8 sp zero1 autocast": Layout(tp=8, dp_shard=8, zero_stage=1, sequence_parallel=True, precision="bf16"),
}
BF16, FP32 = 2, 4


def llama_bytes_per_token(shape: ModelShape, layout: Layout, fsdp: bool) -> float:
    """Korthikanti's per-layer terms (bytes per token, 16-bit activations) with the Llama's own ops."""
    h, t, dkv = shape.dim, layout.tp, shape.n_kv_heads * shape.head_dim
    sp = t if layout.sequence_parallel else 1
    stream = BF16 if fsdp else FP32  # FSDP casts the blocks' inputs to bf16; autocast keeps an fp32 stream
    # sequence parallel: the projections keep their gathered input's shard (Megatron's way); autocast's
    # cast of it, made after the gather, is kept whole
    gathered = sp if fsdp else 1
    terms = {
        # theirs: the two LayerNorms' inputs, 2h each (4h). RMSNorm computes in fp32: it keeps an fp32 input
        # (the upcast of a bf16 stream) and the normalised value in the stream's dtype, each (split by sp)
        "norms": 2 * (FP32 + stream) * h / sp,
        # theirs: the QKV matmul's input, 2h. One bf16 copy for q, k and v (trainer/models/shared_cast.py)
        "attention input": BF16 * h / gathered,
        # theirs: Q and K 4h, V 2h. GQA: K and V are n_kv_heads wide (rotated q and k kept, v)
        "q, k, v": BF16 * (h + 2 * dkv) / t,
        # theirs: softmax 2as/h*h, its dropout mask and output 3as/h*h (the 5as/h term; none with flash),
        # the output projection's input 2h. Here the kernel's output (wo's input) and log-sum-exp (fp32)
        "attention output": (BF16 * h + FP32 * shape.n_heads) / t,
        # theirs: the dropout mask after the attention, 1h; the Llama has no dropout
        # theirs: the MLP's input, 2h. One bf16 copy for w1 and w3
        "mlp input": BF16 * h / gathered,
        # theirs: the 4h-wide fc1 output and GeLU output (16h) and a dropout mask (1h). SwiGLU keeps four
        # ffn-wide tensors: w1's and w3's outputs, silu's output, and the product (w2's input)
        "mlp": 4 * BF16 * shape.ffn_dim / t,
    }
    return sum(terms.values())


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_the_models_block_keeps_what_korthikantis_count_gives_for_the_llamas_ops(shape_name, layout_name):
    shape, layout = SHAPES[shape_name], LAYOUTS[layout_name]
    tokens = 8 * 8192
    expected = tokens * llama_bytes_per_token(shape, layout, fsdp="autocast" not in layout_name)
    assert block_saved_bytes(shape, layout, 0, tokens) == pytest.approx(expected, rel=1e-12)


def test_the_405b_constant_against_korthikantis_34():
    # per block s*b*h*c: c = 34 for their GPT (flash attention). The Llama's is 20 from the norms and the
    # attention (fp32 norm statistics 12 against their 4, no dropout masks), 26 from SwiGLU's four
    # 3.25h-wide tensors (their MLP: 19), 0.25 for GQA's K and V (their K and V: 4)
    shape = SHAPES["405b"]
    c = llama_bytes_per_token(shape, LAYOUTS["fsdp"], fsdp=True) / shape.dim
    assert c == pytest.approx(20 + 26 + 0.25 + 4 * 128 / 16384)
    # tp 8 with sequence parallelism: all of it / 8 (theirs: 34 / 8); under autocast (no FSDP) the two
    # norm outputs' casts stay whole
    c_sp = llama_bytes_per_token(shape, LAYOUTS["tp8 sp"], fsdp=True) / shape.dim
    assert c_sp == pytest.approx(c / 8)


# Llama 3 405B at 8K tokens (The Llama 3 Herd of Models, arXiv 2407.21783, Table 4 and Section 3.3.2): 16,384
# H100 80GB, tp 8 x pp 16 x dp 128 (FSDP), interleaved 1F1B pipeline, 16M tokens a step: 16 sequences of 8,192
# per data-parallel rank, one a micro-batch.
LLAMA3_405B = Layout(
    dp_shard=128,
    tp=8,
    pp=16,
    sequence_parallel=True,
    pp_schedule="interleaved_1f1b",
    pp_microbatches=16,
    precision="bf16",
)
LLAMA3_RUN = RunShape(micro_batch=16, seq_len=8192)
H100 = 80 * 10**9


def test_llama3_405b_at_8k_on_its_published_layout_fits_an_80gb_gpu_with_selective_checkpointing():
    layout = dataclasses.replace(LLAMA3_405B, activation_checkpointing="selective")
    assert per_rank_memory(SHAPES["405b"], layout, LLAMA3_RUN).peak < H100


def test_llama3_405b_at_8k_without_checkpointing_is_over_80gb_by_what_this_llama_keeps_beyond_megatrons():
    # Llama 3 trained this layout without activation checkpointing (Section 3.3.2). This project's Llama
    # keeps per block, beyond Korthikanti's count: its RMSNorms' fp32 statistics (12h against 4h) and
    # SwiGLU's four ffn-wide tensors (26h against 19h): 46.3h / 8 a token, 0.78 GB a block and micro-batch
    # at 8K, against 34h / 8 = 0.57 GB. The first pipeline rank holds 16 micro-batches of its 8 blocks
    # (plus the interleaved schedule's extra warm-up): the model says so rather than fit.
    shape = SHAPES["405b"]
    block = block_saved_bytes(shape, LLAMA3_405B, 0, LLAMA3_RUN.seq_len)
    assert block == pytest.approx(8192 * llama_bytes_per_token(shape, LLAMA3_405B, fsdp=True))
    assert 0.75e9 < block < 0.8e9
    assert per_rank_memory(shape, LLAMA3_405B, LLAMA3_RUN).peak > H100
