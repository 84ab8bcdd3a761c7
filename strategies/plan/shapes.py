"""What the planner knows of a run: the model's shapes, the layout of the world, the batch. Plain data, so the
memory and step-time models read one description of a run and never build a model."""

from __future__ import annotations

from dataclasses import dataclass

# what strategies/techniques/activation_checkpointing.py builds
ACTIVATION_CHECKPOINTING = ("none", "selective", "full")
# checkpointing the planner weighs for a published run but the runtime does not build (never searched):
# TorchTitan's selective "op" policy, which saves the attention kernel's outputs and every matmul's but every
# second one's (torchtitan's _apply_ac_to_transformer_block: "except every second mm")
WHAT_IF_CHECKPOINTING = ("selective_op",)
# what sharded data parallel gathers and frees together: the project's FSDP2 a whole block
# (strategies/techniques/fsdp/apply.py); DeepSpeed's ZeRO-3 each module that holds weights, one linear at a
# time (a what-if, never searched: Narayanan et al. 2021's ZeRO-3 rows)
FSDP_UNITS = ("block", "linear")
PRECISIONS = ("bf16", "fp32")  # bf16: bf16-mixed (fp32 master weights, bf16 compute); fp32: all fp32
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: dense SwiGLU blocks, or MoE blocks when `n_experts` > 0."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int  # the SwiGLU hidden width of a dense block
    tie_embeddings: bool = False
    n_experts: int = 0  # routed experts per MoE block (0: dense)
    top_k: int = 0  # experts each token is routed to
    expert_ffn_dim: int = 0  # the hidden width of one expert
    n_shared_experts: int = 0
    capacity_factor: float | None = None  # None: dropless
    n_dense_layers: int = 0  # the first blocks stay dense (DeepSeek-V3: 3)
    moe_every: int = 1  # after those, every moe_every-th block is MoE

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class Layout:
    """How the world is cut: the mesh sizes (their product is the world) and how each technique is run."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # carved out of dp_shard x cp, as the strategies do
    zero_stage: int = 3  # of the dp_shard dimension: 1, 2 or 3 (dp_shard 1: plain DDP over dp_replicate)
    fsdp_unit: str = "block"  # FSDP_UNITS: what ZeRO 2/3 gathers at once
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    pp_virtual_stages: int = 2  # stages each rank holds under interleaved_1f1b (v); the others hold one
    activation_checkpointing: str = "none"
    loss_chunk_tokens: int | None = (
        None  # the loss fused with the output projection, this many tokens a chunk
    )
    precision: str = "bf16"
    cpu_offload: bool = False
    # elementwise work fused (torch.compile, Megatron-LM's fused kernels), else eager
    fused_kernels: bool = False
    flash_attention: bool = True  # else attention materializes its scores (matmuls, softmax over HBM)

    @property
    def stages_per_rank(self) -> int:
        """v: the pipeline stages one rank holds (interleaved: pp_virtual_stages, else 1)."""
        return self.pp_virtual_stages if self.pp_schedule == "interleaved_1f1b" else 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp


@dataclass(frozen=True)
class RunShape:
    """The batch one rank sees per micro-batch, and the optimizer whose state it keeps."""

    micro_batch: int  # sequences per micro-batch per data-parallel rank
    seq_len: int
    optimizer: str = "adamw"  # adamw: two fp32 states per element; sgd: none (momentum: one)
    accumulation: int = 1  # micro-batches accumulated per optimizer step (each a pipeline step when pp > 1)
