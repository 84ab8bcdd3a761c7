"""A Llama-3-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU, pre-norm blocks.

Parameter names follow Meta's reference code (tok_embeddings, wq/wk/wv/wo, w1/w2/w3, attention_norm,
ffn_norm, output); `trainer.models.hf_llama` maps them to and from Hugging Face `transformers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    """The shape of a Llama model; `preset(name)` gives the published sizes."""

    vocab_size: int = 512
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_hidden: int | None = None  # None: derived from dim by Llama's rule (see `ffn_dim`)
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 256
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; allowed: multiples")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; allowed: a divisor"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim={self.head_dim} (dim / n_heads) is odd; allowed: even (RoPE rotates pairs)"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """The SwiGLU hidden width: `ffn_hidden` if given, else Meta's rule (2/3 of 4*dim, scaled, rounded up)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(2 * 4 * self.dim / 3)  # 2/3 keeps SwiGLU's three matrices at the cost of a 4x GELU MLP
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @classmethod
    def preset(cls, name: str, **overrides: object) -> LlamaConfig:
        """A named size ("tiny", "1b", "8b", "70b") with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"Llama preset {name!r} is unknown; allowed: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# The large presets use the multiple_of / ffn_dim_multiplier of Meta's params.json, which give hidden widths
# 8192, 14336 and 28672. max_seq_len is the 8K pre-training context; Llama 3.1/3.2 reach 128K only with
# "llama3" RoPE frequency scaling, which this model does not implement.
# fmt: off
PRESETS: dict[str, dict[str, object]] = {
    "tiny": dict(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                 rope_theta=10000.0, max_seq_len=256),
    "1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
               multiple_of=256, ffn_dim_multiplier=1.5, max_seq_len=8192, tie_embeddings=True),
    "8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
               multiple_of=1024, ffn_dim_multiplier=1.3, max_seq_len=8192),
    "70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                multiple_of=4096, ffn_dim_multiplier=1.3, max_seq_len=8192),
}
# fmt: on


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 so low-precision activations keep their scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of RoPE for positions 0..max_seq_len-1: dims i and i + head_dim/2 rotate together
    by angle pos * theta^(-2i/head_dim).

    This is the "rotate_half" layout of Hugging Face, not Meta's interleaved pairs (2i, 2i+1): HF's converter
    permuted the wq/wk rows into this layout, so HF weights copy in without any permutation.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.theta = theta
        # Non-persistent: derived from the config, so checkpoints neither carry nor require them.
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Recompute the tables in place (also after `to_empty`, which leaves buffers uninitialised)."""
        max_seq_len, head_dim = self.cos.shape
        device = self.cos.device
        exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / self.theta**exponents  # (head_dim/2,)
        angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (max_seq_len, head_dim)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions 0..seq_len-1 in the activations' dtype."""
        return self.cos[:seq_len].to(dtype), self.sin[:seq_len].to(dtype)  # (T, head_dim) each


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+d/2}) of x (..., T, d) by the angle whose cos/sin (T, d) are given."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts are read from the weights (-1) so a tensor-parallel shard with fewer heads runs unchanged.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_heads, T, head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv_heads, T, head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv_heads, T, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # enable_gqa: query head h reads kv head h // (n_heads / n_kv_heads) inside the kernel. On CPU it still
        # takes the flash kernel and skips copying K/V n_heads / n_kv_heads times; measured (tiny preset, torch
        # 2.13, 2 cores) attention fwd+bwd 15.6 ms vs 17.9 ms with repeat_interleave, a full step ~1-2% faster.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, dim)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The decoder: token embedding, n_layers blocks, final norm, output projection to the vocabulary."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # Build on meta, then allocate on the ambient device and run init_weights once: nn.Linear's own
        # kaiming init is never paid for and thrown away, and a CPU build draws exactly the random numbers
        # that `to_empty` + `init_weights()` draw for a meta build, so both give the same weights per seed.
        device = torch.get_default_device()
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            self.rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)
            self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.to_empty(device=device)
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE tables; on meta tensors this allocates nothing.

        Embeddings and linears draw from normal(0, init_std), GPT-2's choice. The two projections that write
        into the residual stream (wo, w2) use init_std / sqrt(2 * n_layers): each block adds two such terms,
        so the stream's variance at the output stays O(1) as depth grows instead of growing with 2 * n_layers.
        RMSNorm weights start at 1 so every norm begins as a pure rescaling. A tied output shares the
        embedding's init (it is the same tensor).
        """
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        if self.config.tie_embeddings:
            # (Re)tie here because `to_empty` replaces each module's parameter separately, splitting a tie.
            self.output.weight = self.tok_embeddings.weight
        with torch.no_grad():
            nn.init.normal_(self.tok_embeddings.weight, std=std)
            for block in self.layers:
                attention, ffn = block.attention, block.feed_forward
                for linear in (attention.wq, attention.wk, attention.wv, ffn.w1, ffn.w3):
                    nn.init.normal_(linear.weight, std=std)
                for linear in (attention.wo, ffn.w2):
                    nn.init.normal_(linear.weight, std=residual_std)
                nn.init.ones_(block.attention_norm.weight)
                nn.init.ones_(block.ffn_norm.weight)
            nn.init.ones_(self.norm.weight)
            if not self.config.tie_embeddings:
                nn.init.normal_(self.output.weight, std=std)
        self.rope.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab_size) in float32 for token ids (B, T); position t sees tokens 0..t."""
        B, T = tokens.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        cos, sin = self.rope(T, h.dtype)
        for block in self.layers:
            h = block(h, cos, sin)
        return self.output(self.norm(h)).float()  # (B, T, vocab_size)

    def transformer_blocks(self) -> list[nn.Module]:
        """The repeated blocks: units for FSDP wrapping, activation checkpointing and pipeline splits."""
        return list(self.layers)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters, a tied weight counted once; `exclude_embeddings` drops the token embedding table
        (with tied embeddings that is also the output projection)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embeddings else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM's estimate: 6 * N + 12 * n_layers * n_heads * head_dim * seq_len.

        N counts the weights of every matmul: the block linears and the output projection, even when it is
        tied to the embedding (the lookup is free, the projection is not); norms are left out. The second term
        is QK^T and attention-times-V over the full T x T score matrix (no discount for the causal mask).
        """
        n_matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        c = self.config
        return 6 * n_matmul + 12 * c.n_layers * c.n_heads * c.head_dim * seq_len
