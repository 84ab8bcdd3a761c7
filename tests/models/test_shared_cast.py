"""A Llama block under bf16 autocast keeps one bf16 copy of each norm's output for the linears that read it
(trainer/models/shared_cast.py), and trains exactly as with autocast's own cast per linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.models.llama import LlamaConfig, RotaryEmbedding, TransformerBlock, apply_rotary
from trainer.models.shared_cast import shared_cast

CONFIG = LlamaConfig(
    vocab_size=64, dim=96, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=160, max_seq_len=64
)
B, T = 2, 40  # B * T differs from every weight's dim, so saved activations are told apart by shape


def _block() -> tuple[TransformerBlock, RotaryEmbedding]:
    torch.manual_seed(0)
    block = TransformerBlock(CONFIG).to_empty(device="cpu")
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return block, RotaryEmbedding(CONFIG.head_dim, CONFIG.max_seq_len, 1e4)


def _per_linear_casts(block: TransformerBlock, x, cos, sin):
    """The block's forward before shared_cast: each linear reads the fp32 norm output (autocast casts it)."""
    a, f = block.attention, block.feed_forward
    h = block.attention_norm(x)
    q, k, v = (lin(h).view(B, T, -1, a.head_dim).transpose(1, 2) for lin in (a.wq, a.wk, a.wv))
    y = a.attention_fn(apply_rotary(q, cos[:T], sin[:T]), apply_rotary(k, cos[:T], sin[:T]), v)
    x = x + a.wo(y.transpose(1, 2).reshape(B, T, -1))
    h = block.ffn_norm(x)
    return x + f.w2(F.silu(f.w1(h)) * f.w3(h))


def _run(forward) -> tuple[list[torch.Tensor], int]:
    """Output and gradients of (output^2).sum() under bf16 autocast, and how many distinct bf16 storages
    of shape (B * T, dim) autograd kept (the inputs of the linears that read dim features)."""
    block, rope = _block()
    x = torch.randn(B, T, CONFIG.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    storages = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and tuple(t.shape) == (B * T, CONFIG.dim):
            storages.add(t.untyped_storage().data_ptr())
        return t

    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        cos, sin = rope(x.dtype)
        out = forward(block, x, cos, sin)
    (out.float() ** 2).sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in block.parameters())], len(storages)


def test_a_block_keeps_one_bf16_copy_per_norm_output_and_trains_exactly_as_autocast_casting_per_linear():
    ours, copies = _run(lambda block, x, cos, sin: block(x, cos, sin))
    reference, reference_copies = _run(_per_linear_casts)
    # wo's input (the attention's output) is one; then each norm's output: one copy against one per linear
    # (attention norm: q, k, v; ffn norm: w1, w3)
    assert (copies, reference_copies) == (1 + 2, 1 + 5)
    for mine, theirs in zip(ours, reference, strict=True):
        assert torch.equal(mine, theirs)


def test_without_autocast_or_in_the_autocast_dtype_the_input_itself_is_passed_on():
    x = torch.randn(3, 4)
    assert all(y is x for y in shared_cast(x, 3))
    low = x.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(y is low for y in shared_cast(low, 2))
        cast = shared_cast(x, 2)
    assert all(y.dtype == torch.bfloat16 for y in cast)
    assert cast[0].untyped_storage().data_ptr() == cast[1].untyped_storage().data_ptr()
