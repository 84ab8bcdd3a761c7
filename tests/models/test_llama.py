"""The Llama decoder against independent computations: hand-written attention, RoPE's closed form,
published parameter counts and Hugging Face transformers."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys

import pytest
import torch

from trainer.models.hf_llama import from_hf_config, from_hf_state_dict, to_hf_config, to_hf_state_dict
from trainer.models.llama import Attention, Llama, LlamaConfig, RotaryEmbedding, apply_rotary


def small_config(**overrides: object) -> LlamaConfig:
    base = dict(vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=32)
    return LlamaConfig(**{**base, **overrides})


def reference_attention(attn: Attention, x: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + causal mask) V per head, K/V head j serving query heads j*g .. j*g+g-1."""
    B, T, _ = x.shape
    d = attn.head_dim
    q = (x @ attn.wq.weight.T).view(B, T, n_heads, d)
    k = (x @ attn.wk.weight.T).view(B, T, n_kv_heads, d)
    v = (x @ attn.wv.weight.T).view(B, T, n_kv_heads, d)
    group = n_heads // n_kv_heads
    mask = torch.full((T, T), float("-inf")).triu(1)
    heads = []
    for h in range(n_heads):
        qh, kh, vh = q[:, :, h], k[:, :, h // group], v[:, :, h // group]  # (B, T, d)
        scores = qh @ kh.transpose(1, 2) / math.sqrt(d) + mask
        heads.append(torch.softmax(scores, dim=-1) @ vh)
    return torch.cat(heads, dim=-1) @ attn.wo.weight.T


def test_changing_a_future_token_never_changes_earlier_logits() -> None:
    torch.manual_seed(0)
    model = Llama(small_config())
    tokens = torch.randint(0, 101, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (tokens[:, 10] + 1) % 101
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :10], before[:, :10], rtol=0, atol=0)
    assert not torch.allclose(after[:, 10:], before[:, 10:])


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attention_equals_hand_written_softmax_attention(n_kv_heads: int) -> None:
    torch.manual_seed(0)
    cfg = small_config(n_heads=4, n_kv_heads=n_kv_heads)
    attn = Attention(cfg)
    x = torch.randn(2, 12, cfg.dim)
    identity_rotation = torch.ones(12, cfg.head_dim), torch.zeros(12, cfg.head_dim)
    with torch.no_grad():
        ours = attn(x, *identity_rotation)
        expected = reference_attention(attn, x, cfg.n_heads, n_kv_heads)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_rope_rotates_each_pair_by_position_times_theta_power() -> None:
    head_dim, theta, seq_len = 8, 500.0, 6
    rope = RotaryEmbedding(head_dim, max_seq_len=16, theta=theta)
    cos, sin = rope(torch.float64)
    cos, sin = cos[:seq_len], sin[:seq_len]
    x = torch.randn(seq_len, head_dim, dtype=torch.float64)
    ours = apply_rotary(x, cos, sin)
    half = head_dim // 2
    for pos in range(seq_len):
        for i in range(half):
            angle = pos * theta ** (-2 * i / head_dim)
            a, b = x[pos, i].item(), x[pos, i + half].item()
            expected = (a * math.cos(angle) - b * math.sin(angle), a * math.sin(angle) + b * math.cos(angle))
            assert ours[pos, i].item() == pytest.approx(expected[0], abs=1e-5)
            assert ours[pos, i + half].item() == pytest.approx(expected[1], abs=1e-5)


@pytest.mark.parametrize(
    ("preset", "published"), [("1b", 1_235_814_400), ("8b", 8_030_261_248), ("70b", 70_553_706_496)]
)
def test_preset_parameter_counts_equal_published_sizes(preset: str, published: int) -> None:
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset(preset))
    assert model.num_params() == published


def test_meta_build_of_70b_allocates_no_parameter_memory() -> None:
    def rss_bytes() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    with torch.device("meta"):  # the first meta build loads torch's meta kernels (~80 MB of code): not ours
        Llama(LlamaConfig.preset("tiny"))
    gc.collect()
    before = rss_bytes()
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("70b"))
    gc.collect()
    grown = rss_bytes() - before
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    # One 70B layer in bf16 is 1.7 GB and the RoPE tables alone 8 MB; module objects cost ~2 MB.
    assert grown < 6 * 2**20, f"RSS grew by {grown / 2**20:.1f} MB building 70B on meta"


@pytest.mark.parametrize("tied", [False, True], ids=["untied_gqa", "tied_gqa"])
def test_logits_match_hugging_face_llama_with_mapped_weights(
    tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import transformers

    torch.manual_seed(0)
    cfg = small_config(tie_embeddings=tied, rope_theta=10000.0)
    ours = Llama(cfg).eval()
    hf_cfg = to_hf_config(cfg)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.set_attn_implementation("eager")  # HF's plain softmax path, independent of our SDPA call
    hf.load_state_dict(to_hf_state_dict(ours.state_dict()), strict=True)
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    tokens = torch.randint(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    assert from_hf_config(hf_cfg) == cfg


def test_hugging_face_config_with_rope_scaling_is_refused_by_name() -> None:
    hf_cfg = to_hf_config(small_config())
    hf_cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0}
    with pytest.raises(ValueError, match="rope_type='llama3'"):
        from_hf_config(hf_cfg)


def test_state_dict_round_trip_through_hugging_face_names_is_identity() -> None:
    sd = Llama(small_config()).state_dict()
    round_trip = from_hf_state_dict(to_hf_state_dict(sd))
    assert list(round_trip) == list(sd)
    assert all(round_trip[k] is sd[k] for k in sd)


def test_meta_build_materialised_with_init_weights_equals_direct_cpu_build() -> None:
    cfg = small_config(tie_embeddings=True)
    torch.manual_seed(7)
    direct = Llama(cfg)
    torch.manual_seed(7)
    with torch.device("meta"):
        late = Llama(cfg)
    late.to_empty(device="cpu")
    late.init_weights()
    assert late.output.weight is late.tok_embeddings.weight
    direct_tensors = dict(direct.named_parameters()) | dict(direct.named_buffers())
    late_tensors = dict(late.named_parameters()) | dict(late.named_buffers())
    assert direct_tensors.keys() == late_tensors.keys()
    for name, tensor in direct_tensors.items():
        torch.testing.assert_close(
            late_tensors[name], tensor, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_init_scales_residual_projections_by_depth() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig.preset("tiny", n_layers=8)
    model = Llama(cfg)
    block = model.layers["0"]
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2 * 8)
    assert torch.equal(block.ffn_norm.weight, torch.ones(cfg.dim))


def test_flops_per_token_matches_hand_count_for_tiny() -> None:
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("tiny"))
    dim, kv_dim, hidden, vocab, layers, seq_len = 256, 128, 768, 512, 4, 256
    per_layer = dim * dim + 2 * dim * kv_dim + dim * dim + 3 * dim * hidden
    matmul_params = layers * per_layer + dim * vocab
    assert model.flops_per_token(seq_len) == 6 * matmul_params + 12 * layers * 8 * 32 * seq_len


def test_unknown_preset_raises_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"'13b'.*tiny, 1b, 8b, 70b"):
        LlamaConfig.preset("13b")


@pytest.mark.parametrize(
    ("shape", "named"),
    [(dict(dim=100, n_heads=8), "dim=100"), (dict(n_heads=8, n_kv_heads=3), "n_kv_heads=3")],
)
def test_invalid_shapes_raise_value_error_naming_the_values(shape: dict[str, int], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        LlamaConfig.preset("tiny", **shape)


def test_importing_the_model_does_not_import_transformers() -> None:
    code = "import sys, trainer.models.llama; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
