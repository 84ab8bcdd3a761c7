"""strategies/parallelize.py applies the techniques in their one order, and the strategies are presets of
one parallel strategy, none inheriting from another. Run on torch's fake process group (as
`trainer memory` plans): one process plays one rank of the world; nothing is allocated."""

from __future__ import annotations

import pytest

import strategies.parallelize as parallelize_module
from strategies import STRATEGIES, DDPStrategy, FSDPStrategy, MeshStrategy, Parallel3DStrategy, Strategy
from strategies.parallel import ParallelStrategy
from strategies.parallelize import ParallelOptions
from strategies.plan.shards_on_meta import plan_memory
from trainer.models.causal_lm import CausalLM
from trainer.models.llama import LlamaConfig

APPLIED = ("apply_cp", "apply_pp", "apply_tp", "apply_ep", "apply_fsdp_to_experts", "apply_fsdp", "apply_ddp")


def applied_order(monkeypatch, strategy: ParallelStrategy, config: LlamaConfig, world: int) -> list[str]:
    """The techniques `strategy` applied to a CausalLM of `config`, in the order applied, on rank 0."""
    calls: list[str] = []

    def recording(name, function):
        def record(*args, **kwargs):
            calls.append(name)
            return function(*args, **kwargs)

        return record

    for name in APPLIED:
        monkeypatch.setattr(parallelize_module, name, recording(name, getattr(parallelize_module, name)))
    monkeypatch.setattr(strategy, "prepare_blocks", recording("ac+compile", strategy.prepare_blocks))
    plan_memory(strategy, lambda: CausalLM(config), world, ranks=[0])
    return [name for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name]  # one entry per run


def moe_config() -> LlamaConfig:
    moe = dict(n_experts=4, top_k=2, moe_ffn_dim=32, n_shared_experts=1, n_dense_layers=1)
    return LlamaConfig.preset("moe-tiny", vocab_size=64, max_seq_len=16, moe=moe)


def test_context_tensor_expert_parallel_then_blocks_then_fsdp_experts_first(monkeypatch):
    strategy = Parallel3DStrategy(dp_shard=2, cp=2, tp=2, ep=2, activation_checkpointing="full")
    order = applied_order(monkeypatch, strategy, moe_config(), world=8)
    assert order == ["apply_cp", "apply_tp", "apply_ep", "ac+compile", "apply_fsdp_to_experts", "apply_fsdp"]


def test_the_pipeline_cut_comes_first_and_fsdp_shards_each_stage(monkeypatch):
    config = LlamaConfig.preset("tiny", vocab_size=64, max_seq_len=16, tie_embeddings=False)
    order = applied_order(monkeypatch, Parallel3DStrategy(pp=2, tp=2), config, world=4)
    assert order == ["apply_pp", "apply_tp", "ac+compile", "apply_fsdp"]


def test_fsdp_alone_applies_only_blocks_then_fsdp(monkeypatch):
    config = LlamaConfig.preset("tiny", vocab_size=64, max_seq_len=16)
    assert applied_order(monkeypatch, FSDPStrategy(zero_stage=3), config, world=2) == [
        "ac+compile",
        "apply_fsdp",
    ]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_no_strategy_inherits_from_another_concrete_strategy(name):
    bases = {Strategy, MeshStrategy, ParallelStrategy}  # the interface, the process group, the one parallel
    cls = STRATEGIES[name]
    assert set(cls.__bases__) <= bases, f"{cls.__name__} inherits from {cls.__bases__}"
    assert not any(issubclass(cls, other) for other in STRATEGIES.values() if other is not cls)


def test_the_presets_are_the_one_parallel_strategy_with_their_degrees():
    assert isinstance(DDPStrategy(), ParallelStrategy) and DDPStrategy().options.data_parallel == "ddp"
    assert FSDPStrategy(zero_stage=1).options.data_parallel == "zero1"
    three = Parallel3DStrategy(tp=2, pp=2, microbatches=4)
    assert (three.tp, three.pp, three.options.microbatches, three.options.data_parallel) == (2, 2, 4, "fsdp")


def test_options_that_do_not_fit_are_refused_in_one_line():
    with pytest.raises(ValueError, match="data_parallel='zero2' is unknown; allowed: ddp, zero1, fsdp"):
        ParallelOptions(data_parallel="zero2")
    with pytest.raises(ValueError, match="zero_stage=1 does not fit data_parallel='fsdp'; allowed: 2 or 3"):
        ParallelOptions(data_parallel="fsdp", zero_stage=1)
