"""A Llama-3-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU, pre-norm blocks.

Parameter names follow Meta's reference code (tok_embeddings, wq/wk/wv/wo, w1/w2/w3, attention_norm,
ffn_norm, output); `trainer.models.hf_llama` maps them to and from Hugging Face `transformers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.moe import (
    MoE,
    moe_layers,
    moe_stats,
    summed_extra_loss,
)
from trainer.models.moe_config import MoEConfig
from trainer.models.shared_cast import shared_cast


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
    moe: MoEConfig | None = None  # None: every block dense (a dict is turned into a MoEConfig)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from a preset, a YAML config or dataclasses.asdict of a checkpoint
            self.moe = MoEConfig(**self.moe)
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
        """A named size ("tiny", "1b", "8b", "70b"; MoE: "moe-tiny", "mixtral-8x7b", "deepseek-v3-like")
        with any field overridden."""
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
    # Mixture of experts (trainer.models.moe). mixtral-8x7b is Mixtral's exact shape (46.70B total, 12.88B
    # active). deepseek-v3-like has DeepSeek-V3's MoE shape but our multi-head attention (128 heads of 56)
    # instead of MLA, and no multi-token-prediction module; its counts are in tests/models/test_moe.py.
    "moe-tiny": dict(vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                     rope_theta=10000.0, max_seq_len=64,
                     moe=dict(n_experts=8, top_k=2, moe_ffn_dim=32, n_shared_experts=1, n_dense_layers=1,
                              aux_loss_coef=0.01, z_loss_coef=0.001)),
    "mixtral-8x7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                         norm_eps=1e-5, rope_theta=1e6, max_seq_len=32768,
                         moe=dict(n_experts=8, top_k=2, moe_ffn_dim=14336)),
    "deepseek-v3-like": dict(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                             ffn_hidden=18432, norm_eps=1e-6, rope_theta=10000.0, max_seq_len=4096,
                             moe=dict(n_experts=256, top_k=8, moe_ffn_dim=2048, n_shared_experts=1,
                                      n_dense_layers=3, score_func="sigmoid", bias_update_rate=1e-3)),
}
# fmt: on


# Each matrix of `Llama.init_weights` draws from a generator seeded by one global draw plus its place in
# this order: the embedding, then a fixed run of slots per block (a block's seeds do not depend on which
# blocks a pipeline stage holds), then the output, then a run per block for MoE feed-forwards (after
# every dense seed, so adding MoE left a dense model's initial values as they were).
EMBEDDING_SEED = 0
BLOCK_SLOTS = ("wq", "wk", "wv", "w1", "w3", "wo", "w2")  # a dense block's matrices, in seed order
MOE_SLOTS = 7  # MoE.init_weights' seeds: router, experts w1 w3 w2, shared experts w1 w3 w2


def block_seeds(layer: int) -> dict[str, int]:
    """The seed offset of each matrix of block `layer` (a MoE block uses only the attention's)."""
    first = EMBEDDING_SEED + 1 + len(BLOCK_SLOTS) * layer
    return {key: first + slot for slot, key in enumerate(BLOCK_SLOTS)}


def output_seed(n_layers: int) -> int:
    """The output projection's seed offset: right after the last block's slots."""
    return EMBEDDING_SEED + 1 + len(BLOCK_SLOTS) * n_layers


def moe_seeds(layer: int, n_layers: int) -> list[int]:
    """The MOE_SLOTS seed offsets of block `layer`'s MoE feed-forward, after the output's."""
    first = output_seed(n_layers) + 1 + MOE_SLOTS * layer
    return list(range(first, first + MOE_SLOTS))


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

    def forward(
        self, dtype: torch.dtype, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (max_seq_len, head_dim) in the activations' dtype, or only the rows of `positions`
        (a context-parallel shard of the sequence); attention takes the first T rows."""
        if positions is None:
            return self.cos.to(dtype), self.sin.to(dtype)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+d/2}) of x (..., T, d) by the angle whose cos/sin (T, d) are given."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v under the causal mask; query head h reads kv head h // (Hq / Hkv).

    enable_gqa: on the CPU it still takes the flash kernel and skips copying K/V n_heads / n_kv_heads
    times; measured (tiny preset, torch 2.13, 2 cores) attention fwd+bwd 15.6 ms vs 17.9 ms with
    repeat_interleave, a full step ~1-2% faster.
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    """Causal grouped-query attention: n_heads query heads share n_kv_heads key/value heads.

    `attention_fn(q, k, v)` is the attention kernel: a strategy may replace it (context parallelism
    gathers K/V over the ranks that share the sequence).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.attention_fn = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        cos, sin = cos[:T], sin[:T]
        xq, xk, xv = shared_cast(x, 3)  # one autocast copy for the three to keep, not one each
        # Head counts are read from the weights (-1) so a tensor-parallel shard with fewer heads runs unchanged.
        q = self.wq(xq).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_heads, T, head_dim)
        k = self.wk(xk).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv_heads, T, head_dim)
        v = self.wv(xv).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv_heads, T, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.attention_fn(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, dim)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x3 = shared_cast(x, 2)  # one autocast copy kept for w1 and w3
        return self.w2(F.silu(self.w1(x1)) * self.w3(x3))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + feed_forward(norm(x)); the feed-forward
    is a MoE layer when `moe` is true (its config from config.moe)."""

    def __init__(self, config: LlamaConfig, moe: bool = False) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward: nn.Module
        if moe:
            assert config.moe is not None
            self.feed_forward = MoE(config.dim, config.moe)
        else:
            self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The decoder: token embedding, n_layers blocks, final norm, output projection to the vocabulary.

    For pipeline parallelism a stage is this model with parts removed: `layers` is a ModuleDict keyed by
    the block's index (so a stage's state-dict keys are the full model's), and a stage without the
    embedding takes hidden states (B, T, dim) as input, one without the norm and output returns them.
    """

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
            self.layers = nn.ModuleDict(
                {str(i): TransformerBlock(config, self.is_moe_layer(i)) for i in range(config.n_layers)}
            )
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.positions_fn: Any = None  # context parallelism: the positions of this rank's tokens
        self.to_empty(device=device)
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE tables; on meta tensors this allocates nothing.

        Embeddings and linears draw from normal(0, init_std), GPT-2's choice. The two projections that write
        into the residual stream (wo, w2) use init_std / sqrt(2 * n_layers): each block adds two such terms,
        so the stream's variance at the output stays O(1) as depth grows instead of growing with 2 * n_layers.
        RMSNorm weights start at 1 so every norm begins as a pure rescaling. A tied output shares the
        embedding's init (it is the same tensor).

        Each matrix draws from its own generator, seeded by one draw from the global RNG plus the
        matrix's place in the full model (`block_seeds`, `output_seed`, `moe_seeds`): a pipeline stage
        holding only some layers gets exactly the values those layers have in the whole model, and the
        seed still decides everything.
        """
        c = self.config
        std, residual_std = c.init_std, c.init_std / math.sqrt(2 * c.n_layers)

        def normal(weight: torch.Tensor, std: float, index: int) -> None:
            generator = torch.Generator(weight.device).manual_seed(base + index)
            nn.init.normal_(weight, std=std, generator=generator)

        if c.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            # (Re)tie here because `to_empty` replaces each module's parameter separately, splitting a tie.
            self.output.weight = self.tok_embeddings.weight
        if any(p.is_meta for p in self.parameters()):
            return  # nothing to fill, and no draw: a meta build and its materialisation draw once in all
        base = int(torch.randint(0, 2**62, (), device="cpu").item())
        with torch.no_grad():
            if self.tok_embeddings is not None:
                normal(self.tok_embeddings.weight, std, EMBEDDING_SEED)
            for name, block in self.layers.items():
                seeds = block_seeds(int(name))
                attention, ffn = block.attention, block.feed_forward
                for key in ("wq", "wk", "wv"):
                    normal(getattr(attention, key).weight, std, seeds[key])
                normal(attention.wo.weight, residual_std, seeds["wo"])
                if isinstance(ffn, MoE):  # seeds after the output's (see moe_seeds)
                    ffn.init_weights(normal, std, residual_std, moe_seeds(int(name), c.n_layers))
                else:
                    normal(ffn.w1.weight, std, seeds["w1"])
                    normal(ffn.w3.weight, std, seeds["w3"])
                    normal(ffn.w2.weight, residual_std, seeds["w2"])
                nn.init.ones_(block.attention_norm.weight)
                nn.init.ones_(block.ffn_norm.weight)
            if self.output is not None:
                nn.init.ones_(self.norm.weight)
                if not c.tie_embeddings:
                    normal(self.output.weight, std, output_seed(c.n_layers))
        self.rope.reset_parameters()

    def forward(
        self, tokens: torch.Tensor, aux: torch.Tensor | None = None, *, hidden_only: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, vocab_size) in float32 for token ids (B, T); position t sees tokens 0..t.
        With `hidden_only`, the final norm's output (B, T, dim) instead, for a loss that applies `output`
        itself (trainer.models.linear_cross_entropy).
        A pipeline stage without the embedding takes, and one without the output returns, hidden states.
        A pipeline stage of a MoE model also takes (after the first) and returns the weighted auxiliary
        losses `aux` of the stages so far plus its own, so that the last stage's loss holds every
        stage's and their gradients flow back through the schedule like the activations'."""
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_seq_len={self.config.max_seq_len}"
            )
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, dim)
        cos, sin = self.rope(h.dtype, self.positions_fn() if self.positions_fn is not None else None)
        for block in self.layers.values():
            h = block(h, cos, sin)
        if self.output is None:
            out = h
        elif hidden_only:
            out = self.norm(h)  # (B, T, dim)
        else:
            out = self.output(self.norm(h)).float()  # (B, T, vocab_size)
        if self.config.moe is None or (self.tok_embeddings is not None and self.output is not None):
            return out
        own = summed_extra_loss(moe_layers(self.layers))
        if own is None:  # a stage of dense blocks only
            own = torch.zeros((), device=h.device)
        return out, own if aux is None else aux + own

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` has a MoE feed-forward."""
        return self.config.moe is not None and self.config.moe.is_moe_layer(index)

    def extra_loss(self) -> torch.Tensor | None:
        """The weighted MoE auxiliary losses (load balancing + router z-loss) of the last forward, summed
        over this model's MoE layers, for the training loss to add; None for a dense model. Under tensor
        parallelism the value covers every tp rank's tokens (see trainer.models.moe.summed_extra_loss)."""
        if self.config.moe is None:  # every training step asks: a dense model answers without a module walk
            return None
        return summed_extra_loss(moe_layers(self))

    def moe_stats(self, all_reduce: Any = None) -> dict[str, float]:
        """Router statistics of the last forward as floats, {} if dense; `all_reduce(tensor)` sums over
        the ranks that route other tokens or hold other blocks (see trainer.models.moe.moe_stats)."""
        if self.config.moe is None:
            return {}
        held = {int(name): block.feed_forward for name, block in self.layers.items()}  # a stage holds some
        slots = [held.get(i) for i in range(self.config.n_layers) if self.is_moe_layer(i)]
        return moe_stats(slots, self.config.moe, self.rope.cos.device, all_reduce)

    def expert_modules(self) -> list[nn.Module]:
        """The MoE feed-forwards this model holds (a pipeline stage: its own), [] if dense: what strategies
        shard over expert parallelism and balance after each optimizer step (trainer/models/moe.py)."""
        return moe_layers(self)

    def num_active_params(self) -> int:
        """Parameters one token uses: all but the (n_experts - top_k) unchosen routed experts of each
        MoE block; equals num_params() for a dense model."""
        n = self.num_params()
        for m in moe_layers(self):
            per_expert = (
                m.experts.w1.numel() + m.experts.w2.numel() + m.experts.w3.numel()
            ) // m.config.n_experts
            n -= (m.config.n_experts - m.config.top_k) * per_expert
        return n

    def transformer_blocks(self) -> list[nn.Module]:
        """The repeated blocks: units for FSDP wrapping, activation checkpointing and pipeline splits."""
        return list(self.layers.values())

    def pipeline_layout(self) -> tuple[list[str], str, list[str]]:
        """How a pipeline cuts this model: the modules before the blocks (first stage only), the
        ModuleDict of blocks (split between stages), the modules after them (last stage only)."""
        return ["tok_embeddings"], "layers", ["norm", "output"]

    def enable_context_parallel(self, attention_fn: Any, positions_fn: Any) -> None:
        """Context parallelism: every block's attention uses `attention_fn(q, k, v)`, and RoPE reads
        the positions `positions_fn()` says this rank's tokens hold."""
        for block in self.layers.values():
            block.attention.attention_fn = attention_fn
        self.positions_fn = positions_fn

    def tensor_parallel_plan(self, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
        """Module path -> DTensor parallel style for tensor parallelism (trainer/models/llama_tp_plan.py)."""
        from trainer.models.llama_tp_plan import tensor_parallel_plan

        return tensor_parallel_plan(self, sequence_parallel, loss_parallel)

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
        A MoE block counts its active weights: the router, top_k routed experts and the shared experts.
        """
        c = self.config
        attention = c.dim * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)  # wq, wo; wk, wv
        # from the config, not the modules: a pipeline stage or tensor-parallel shard holds part of them
        n_matmul = c.n_layers * (attention + 3 * c.dim * c.ffn_dim) + c.dim * c.vocab_size
        if c.moe is not None:
            m = c.moe
            moe_ffn = c.dim * m.n_experts + 3 * c.dim * m.moe_ffn_dim * (m.top_k + m.n_shared_experts)
            n_matmul += sum(
                moe_ffn - 3 * c.dim * c.ffn_dim for i in range(c.n_layers) if self.is_moe_layer(i)
            )
        return 6 * n_matmul + 12 * c.n_layers * c.n_heads * c.head_dim * seq_len
