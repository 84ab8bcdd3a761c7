"""transformers' tensor-parallel plan styles as DTensor styles (trainer/models/hf_tp_plan.py): what each style
name becomes, what stays whole, and the one-line refusals naming the style, the module and the model type.
That the mapped plans train like one process: test_hf_matrix.py."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from transformers import GPTNeoXConfig, LlamaConfig

from trainer.models.hf import HFModule

TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def plan_of(config, plan: dict[str, str] | None = None) -> dict:
    if plan is not None:
        config.base_model_tp_plan = plan
    return HFModule(config).tensor_parallel_plan(sequence_parallel=False, loss_parallel=False)


def test_each_style_becomes_a_dtensor_style_of_the_same_layout():
    plan = plan_of(
        LlamaConfig(**TINY),
        {
            "embed_tokens": "embedding_rowwise",
            "layers.*.self_attn.q_proj": "colwise",
            "layers.*.self_attn.k_proj": "colwise_rep",
            "layers.*.self_attn.v_proj": "colwise_gather_output",
            "layers.*.self_attn.o_proj": "rowwise_rep",
            "layers.*.mlp.gate_proj": "local_colwise",
            "layers.*.mlp.up_proj": "packed_colwise",
            "layers.*.mlp.down_proj": "rowwise_split_input",
            "layers.*.input_layernorm": "replicated_with_grad_allreduce",
            "layers.*.post_attention_layernorm": "replicate",  # nothing to do: whole on every rank
            "layers.*.cross_attn.q_proj": "colwise",  # a module this config lacks: nothing to split
        },
    )
    base = "model.model."  # HFModule.model, then LlamaForCausalLM's base model
    assert sorted(plan) == sorted(
        base + p
        for p in (
            "embed_tokens",
            "layers.*.self_attn.q_proj",
            "layers.*.self_attn.k_proj",
            "layers.*.self_attn.v_proj",
            "layers.*.self_attn.o_proj",
            "layers.*.mlp.gate_proj",
            "layers.*.mlp.up_proj",
            "layers.*.mlp.down_proj",
            "layers.*.input_layernorm",
        )
    )

    def style(path: str):
        return plan[base + path]

    # a column split: output sharded over its last dim, or gathered back whole (_rep, _gather_output)
    assert type(style("layers.*.self_attn.q_proj")) is ColwiseParallel
    assert style("layers.*.self_attn.q_proj").output_layouts == (Shard(-1),)
    for gathered in ("layers.*.self_attn.k_proj", "layers.*.self_attn.v_proj"):
        assert type(style(gathered)) is ColwiseParallel and style(gathered).output_layouts == (Replicate(),)
    assert type(style("layers.*.mlp.gate_proj")) is ColwiseParallel
    # a row split: input sharded, or a replicated input split here (_rep, _split_input); the output summed
    assert type(style("layers.*.self_attn.o_proj")) is RowwiseParallel
    assert style("layers.*.self_attn.o_proj").input_layouts == (Replicate(),)
    assert style("layers.*.mlp.down_proj").input_layouts == (Replicate(),)
    assert style("layers.*.mlp.down_proj").output_layouts == (Replicate(),)
    # the vocabulary split of an embedding: replicated ids, partial lookups summed
    assert type(style("embed_tokens")) is RowwiseParallel
    assert style("embed_tokens").input_layouts == (Replicate(),)
    # a packed projection: a column split per packed part
    assert isinstance(style("layers.*.mlp.up_proj"), ColwiseParallel)
    assert type(style("layers.*.mlp.up_proj")).__name__ == "PackedColwiseParallel"
    # a norm over each rank's own heads: replicated weight, rows split
    norm = style("layers.*.input_layernorm")
    assert type(norm) is SequenceParallel and norm.sequence_sharding == (Shard(-2),)


def test_transformers_own_plans_map_whole():
    """Every entry of the families' own plans is mapped (GPT-NeoX's embedding included, untied)."""
    neox = plan_of(GPTNeoXConfig(**{k: v for k, v in TINY.items() if k != "num_key_value_heads"}))
    assert sorted(neox) == sorted(f"model.gpt_neox.{p}" for p in GPTNeoXConfig.base_model_tp_plan)
    assert type(neox["model.gpt_neox.embed_in"]) is RowwiseParallel


def test_an_embedding_tied_to_the_head_stays_whole():
    fields = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    plan = plan_of(GPTNeoXConfig(**fields, tie_word_embeddings=True))
    assert "model.gpt_neox.embed_in" not in plan and "model.gpt_neox.layers.*.attention.dense" in plan


@pytest.mark.parametrize(
    "pattern,style,says",
    [
        ("layers.*.mlp", "moe_tp_experts", "MoE experts"),
        ("layers.*.mlp", "gather", "partial outputs"),
        ("norm", "sequence_parallel", "sequence"),
        ("layers.*.self_attn.q_proj", "unit_colwise", "whole heads"),
        ("layers.*.self_attn.q_proj", "fancy_split", "does not know"),
        ("layers.*.self_attn.q_proj.weight", "colwise", "names a parameter"),
        ("norm", "colwise", "splits torch.nn.Linear layers, but matches a transformers.models.llama."),
        (
            "layers.*.self_attn.q_proj",
            "embedding_rowwise",
            "splits torch.nn.Embedding layers, but matches a torch",
        ),
    ],
)
def test_a_style_without_a_dtensor_equivalent_is_refused_in_one_line(pattern, style, says):
    with pytest.raises(ValueError) as err:
        plan_of(LlamaConfig(**TINY), {pattern: style})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"LlamaForCausalLM ('llama'): tensor-parallel style {style!r} on {pattern!r}")
    assert says in message and message.endswith("allowed: tp=1")


def test_sequence_and_loss_parallel_are_refused():
    with pytest.raises(ValueError, match="sequence_parallel=False, loss_parallel=False"):
        HFModule(LlamaConfig(**TINY)).tensor_parallel_plan(sequence_parallel=True, loss_parallel=False)
