"""Mixture-of-Experts: routing, capacity, auxiliary losses, bias balancing, grouped matmul, the MoE Llama."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import fit, read_metrics
from torch.utils.checkpoint import checkpoint

from strategies import SingleDeviceStrategy
from trainer.config import ConfigError, build_llama_config, load_recipe
from trainer.models.causal_lm import CausalLM
from trainer.models.llama import Llama, LlamaConfig
from trainer.models.moe import MoE, moe_stats
from trainer.models.moe_config import MoEConfig
from trainer.models.moe_experts import GroupedExperts, grouped_mm, grouped_mm_loop, grouped_mm_supported
from trainer.models.moe_router import Router


def make_moe(dim: int = 16, seed: int = 0, **overrides: object) -> MoE:
    config = MoEConfig(**{**dict(n_experts=4, top_k=2, moe_ffn_dim=8), **overrides})
    torch.manual_seed(seed)
    moe = MoE(dim, config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.5)
    moe.router.reset_buffers()
    return moe


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Loop over tokens and their top-k experts, with routing and capacity recomputed from scratch."""
    c = moe.config
    logits = x @ moe.router.gate.weight.T
    scores = torch.softmax(logits, -1) if c.score_func == "softmax" else torch.sigmoid(logits)
    idx = torch.topk(scores + moe.router.expert_bias, c.top_k).indices
    n = x.shape[0]
    kept = {(t, j) for t in range(n) for j in range(c.top_k)}
    if c.capacity_factor is not None:
        capacity = math.ceil(n * c.top_k / c.n_experts * c.capacity_factor)
        for e in range(c.n_experts):
            pairs = [(scores[t, e].item(), t, j) for t in range(n) for j in range(c.top_k) if idx[t, j] == e]
            for _, t, j in sorted(pairs, reverse=True)[capacity:]:
                kept.discard((t, j))
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    y = torch.zeros_like(x)
    for t in range(n):
        gates = scores[t, idx[t]]
        if c.normalise_gates:
            gates = gates / gates.sum()
        for j in range(c.top_k):
            if (t, j) in kept:
                e = idx[t, j]
                y[t] += gates[j] * ((F.silu(x[t] @ w1[e]) * (x[t] @ w3[e])) @ w2[e])
    if moe.shared_experts is not None:
        y += moe.shared_experts(x)
    return y


# ---- routing and capacity -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(capacity_factor=0.5),
        dict(score_func="sigmoid", n_shared_experts=1),
        dict(score_func="sigmoid", top_k=3, capacity_factor=0.75, n_shared_experts=2),
        dict(top_k=1),
    ],
)
def test_moe_layer_equals_naive_token_loop(overrides: dict) -> None:
    moe = make_moe(**overrides)
    x = torch.randn(24, 16)
    assert torch.allclose(moe(x), naive_moe(moe, x), atol=1e-6, rtol=1e-5)


def test_enough_capacity_drops_nothing() -> None:
    moe = make_moe(capacity_factor=4.0)  # capacity = all N*k pairs: nothing can overflow
    moe(torch.randn(32, 16))
    assert moe_stats([moe], moe.config, torch.device("cpu"))["dropped_frac"] == 0.0
    assert moe.stats["load"].sum().item() == 64


def test_capacity_caps_each_expert_and_drops_the_lowest_scores() -> None:
    moe = make_moe(capacity_factor=0.5)
    x = torch.randn(32, 16)
    routing = moe.router(x)
    capacity = math.ceil(0.5 * 32 * 2 / 4)  # 8
    raw = torch.bincount(routing.indices.flatten(), minlength=4)
    assert raw.max() > capacity  # the example does overflow
    kept = torch.bincount(routing.indices[routing.keep], minlength=4)
    assert torch.equal(kept, raw.clamp(max=capacity))
    moe(x)
    hand_dropped = sum(max(0, int(r) - capacity) for r in raw) / 64
    assert moe_stats([moe], moe.config, x.device)["dropped_frac"] == pytest.approx(hand_dropped, abs=1e-7)
    for e in range(4):  # "probs" policy: every kept pair of e scores above every dropped one
        chosen = routing.indices == e
        score = routing.scores[:, e : e + 1].expand_as(chosen)
        k_scores, d_scores = score[chosen & routing.keep], score[chosen & ~routing.keep]
        if d_scores.numel():
            assert k_scores.min() > d_scores.max()


# ---- auxiliary losses ----------------------------------------------------------------------------


def test_aux_and_z_loss_equal_their_formulas_by_hand() -> None:
    config = MoEConfig(n_experts=3, top_k=1, moe_ffn_dim=4)
    router = Router(2, config)
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]))
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 3.0]])
    logits = [[2.0, 0.0, 1.0], [0.0, 1.0, 0.5], [1.0, 0.0, 0.5], [0.0, 3.0, 1.5]]
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits]
    # top-1 choices: expert 0, 1, 0, 1 -> f = (2/4, 2/4, 0)
    f = [0.5, 0.5, 0.0]
    p_mean = [sum(p[e] for p in probs) / 4 for e in range(3)]
    aux = 3 * sum(f[e] * p_mean[e] for e in range(3))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / 4
    routing = router(x)
    assert routing.indices.flatten().tolist() == [0, 1, 0, 1]
    assert routing.aux_loss.item() == pytest.approx(aux, rel=1e-6)
    assert routing.z_loss.item() == pytest.approx(z, rel=1e-6)
    assert routing.gates.flatten().tolist() == pytest.approx(
        [probs[t][e] for t, e in enumerate([0, 1, 0, 1])]
    )


def test_top_k_counts_each_choice_in_the_load_fraction() -> None:
    config = MoEConfig(n_experts=3, top_k=2, moe_ffn_dim=4)
    router = Router(2, config)
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]))
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    routing = router(x)  # choices {0, 2} and {1, 2}: f = (1/4, 1/4, 2/4)
    probs = torch.softmax(x @ router.gate.weight.T, -1).mean(0)
    expected = 3 * (0.25 * probs[0] + 0.25 * probs[1] + 0.5 * probs[2])
    assert routing.aux_loss.item() == pytest.approx(expected.item(), rel=1e-6)


# ---- auxiliary-loss-free balancing ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("load", "expected"),
    [([5.0, 1.0, 3.0, 3.0], [-0.1, 0.1, 0.0, 0.0]), ([6.0, 1.0, 1.0, 0.0], [-0.15, 0.05, 0.05, 0.05])],
)
def test_bias_update_is_rate_times_sign_mean_centred(load: list[float], expected: list[float]) -> None:
    router = Router(2, MoEConfig(n_experts=4, top_k=2, moe_ffn_dim=4, bias_update_rate=0.1))
    router.reset_buffers()
    router.tokens_per_expert.copy_(torch.tensor(load))
    router.update_expert_bias()
    assert router.expert_bias.tolist() == pytest.approx(expected, abs=1e-7)
    assert router.tokens_per_expert.sum().item() == 0  # consumed


def test_the_strategy_moves_the_biases_of_the_expert_modules_after_the_optimizer_step() -> None:
    torch.manual_seed(0)
    config = LlamaConfig.preset("moe-tiny")
    config.moe = dataclasses.replace(config.moe, bias_update_rate=0.1)
    module = CausalLM(config)
    module.configure_model()
    strategy = SingleDeviceStrategy()
    strategy.setup_module(module)
    layers = module.expert_modules()
    assert layers == [m for m in module.modules() if isinstance(m, MoE)] and len(layers) == 3
    module.train()
    module.training_step(
        {"input_ids": torch.randint(0, 512, (2, 16)), "labels": torch.zeros(2, 16).long()}, 0
    )
    loads = [m.router.tokens_per_expert.clone() for m in layers]
    assert all(load.sum() == 2 * 16 * 2 for load in loads)  # every (token, choice) pair counted
    strategy.after_optimizer_step()
    for m, load in zip(layers, loads, strict=True):
        delta = 0.1 * torch.sign(load.mean() - load)
        assert torch.equal(m.router.expert_bias, delta - delta.mean()) and delta.abs().sum() > 0
        assert m.router.tokens_per_expert.sum() == 0  # the next step counts afresh


def test_top_k_uses_score_plus_bias_but_gates_use_raw_scores() -> None:
    moe = make_moe(score_func="sigmoid", bias_update_rate=0.01, route_norm=False)
    x = torch.randn(16, 16)
    moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 5.0]))  # forces experts 2 and 3
    routing = moe.router(x)
    assert sorted(set(routing.indices.flatten().tolist())) == [2, 3]
    scores = torch.sigmoid(x @ moe.router.gate.weight.T)
    assert torch.allclose(routing.gates, scores.gather(-1, routing.indices))
    assert torch.allclose(moe(x), naive_moe(moe, x), atol=1e-6)
    assert "router.expert_bias" in moe.state_dict()
    assert "router.tokens_per_expert" not in moe.state_dict()


def test_router_stats_summed_over_ranks_equal_one_process_over_their_tokens() -> None:
    whole, half = make_moe(), make_moe()  # the same weights
    x = torch.randn(32, 16)
    whole(x)
    rows: list[torch.Tensor] = []
    half(x[16:])
    moe_stats([half], half.config, x.device, all_reduce=rows.append)  # what "rank 1" contributes
    half.reset_stats()
    half(x[:16])
    got = moe_stats([half], half.config, x.device, all_reduce=lambda t: t.add_(rows[0]))
    expected = moe_stats([whole], whole.config, x.device)
    assert got.keys() == expected.keys() and expected["load_cv"] > 0
    for key in expected.keys() - {"aux_loss"}:  # the load-balancing loss is a product of per-rank means
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key


def test_load_is_counted_once_under_activation_checkpointing_and_not_without_grad() -> None:
    moe = make_moe(bias_update_rate=0.01)
    x = torch.randn(8, 16, requires_grad=True)
    with torch.no_grad():
        moe(x)
    assert moe.router.tokens_per_expert.sum().item() == 0
    moe(x).sum().backward()
    plain = moe.router.tokens_per_expert.clone()
    assert plain.sum().item() == 16
    moe.router.tokens_per_expert.zero_()
    checkpoint(moe, x, use_reentrant=False).sum().backward()  # the backward recomputes the forward
    assert torch.equal(moe.router.tokens_per_expert, plain)


# ---- grouped matmul ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_per_expert_loop_with_empty_experts(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    experts = GroupedExperts(8, 16, 5).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.5)
    counts = torch.tensor([3, 0, 5, 0, 2])
    x = torch.randn(10, 8, dtype=dtype)
    assert grouped_mm_supported(x, experts.w1) and grouped_mm_supported(x, experts.w2.transpose(1, 2))
    results = []
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        xi = x.clone().requires_grad_()
        y = experts(xi, counts)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y).to(dtype)).sum().backward()
        results.append([y, xi.grad] + [p.grad for p in experts.parameters()])
        experts.zero_grad(set_to_none=True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, **tol)
    assert results[0][2][1].abs().sum() == 0 and results[0][2][3].abs().sum() == 0  # empty experts


def test_grouped_experts_under_bf16_autocast_take_the_grouped_path_and_match_the_loop() -> None:
    torch.manual_seed(0)
    experts = GroupedExperts(8, 16, 3)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.5)
    x, counts = torch.randn(10, 8), torch.tensor([4, 0, 6])
    outs = []
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(experts(x, counts))
    assert outs[0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


def test_grouped_mm_falls_back_to_the_loop_where_its_rules_do_not_hold() -> None:
    x, w = torch.randn(6, 7), torch.randn(3, 7, 5)  # strides of 7 and 5 floats: not 16-byte multiples
    counts = torch.tensor([2, 4, 0])
    assert not grouped_mm_supported(x, w)
    assert not grouped_mm_supported(x.double(), w.double())
    assert not grouped_mm_supported(torch.randn(0, 8), torch.randn(3, 8, 4))
    assert torch.equal(grouped_mm(x, w, counts), grouped_mm_loop(x, w, counts))
    assert grouped_mm(torch.randn(0, 8), torch.randn(3, 8, 4), torch.zeros(3, dtype=torch.long)).shape == (
        0,
        4,
    )


# ---- the MoE Llama -------------------------------------------------------------------------------


def test_moe_llama_blocks_stats_and_extra_loss() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("moe-tiny"))
    assert [isinstance(b.feed_forward, MoE) for b in model.transformer_blocks()] == [False, True, True, True]
    assert model.extra_loss() is None and model.moe_stats() == {}
    model(torch.randint(0, 512, (2, 16)))
    stats = model.moe_stats()
    layers = [b.feed_forward for b in model.transformer_blocks()[1:]]
    expected = sum(0.01 * m.aux_loss + 0.001 * m.z_loss for m in layers)
    assert model.extra_loss().item() == pytest.approx(expected.item(), rel=1e-6)
    assert stats["aux_loss"] == pytest.approx(sum(m.aux_loss.item() for m in layers), rel=1e-6)
    assert sum(stats[f"load_e{i}"] for i in range(8)) == 3 * 32 * 2
    assert stats["dropped_frac"] == 0.0 and stats["imbalance"] >= 1.0
    assert {"z_loss", "load_min", "load_max", "load_cv", "bias_min", "bias_max"} <= stats.keys()


def test_moe_config_round_trips_through_asdict_and_dense_default_is_unchanged() -> None:
    config = LlamaConfig.preset("moe-tiny")
    assert LlamaConfig(**dataclasses.asdict(config)) == config
    assert LlamaConfig().moe is None
    assert not any(isinstance(m, MoE) for m in Llama(LlamaConfig.preset("tiny", n_layers=1)).modules())


def test_flops_per_token_counts_active_parameters() -> None:
    c = LlamaConfig.preset("moe-tiny")
    attention = c.dim * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    dense = 3 * c.dim * c.ffn_dim
    moe = c.dim * 8 + 3 * c.dim * 32 * (2 + 1)  # router, 2 routed + 1 shared expert
    n = 4 * attention + dense + 3 * moe + c.dim * c.vocab_size
    with torch.device("meta"):
        model = Llama(c)
    assert model.flops_per_token(16) == 6 * n + 12 * 4 * c.n_heads * c.head_dim * 16


def test_mixtral_preset_has_the_published_parameter_counts() -> None:
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("mixtral-8x7b"))
    assert model.num_params() == 46_702_792_704  # Mixtral-8x7B's 46.7B
    assert model.num_active_params() == 12_879_925_248  # "12.9B active"


def test_deepseek_v3_like_preset_differs_from_published_counts_only_by_attention() -> None:
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("deepseek-v3-like"))
    total, active = model.num_params(), model.num_active_params()
    assert (total, active) == (672_149_632_000, 38_675_510_272)
    # DeepSeek-V3's MLA per layer (q_lora 1536, kv_lora 512, rope 64, nope/v head 128, 128 heads) vs our
    # multi-head attention 4 * dim^2.
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    extra = 61 * (4 * 7168 * 7168 - mla)  # 1.12B
    assert abs((total - extra) / 671e9 - 1) < 1e-3  # 671.03B: the published 671B (without the MTP module)
    assert abs((active - extra) / 37e9 - 1) < 0.02  # 37.55B: the published 37B activated


def test_tiny_moe_llama_trains_with_the_trainer_logging_its_router_and_moving_its_biases(tmp_path) -> None:
    config = LlamaConfig.preset("moe-tiny", vocab_size=32, max_seq_len=16)
    config.moe = dataclasses.replace(config.moe, bias_update_rate=1e-3, capacity_factor=1.5)
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 32, (8, 1), generator=g)
    batches = []
    for i in range(4):
        ids = (start + i + torch.arange(17)) % 32  # counting sequences: learnable next token
        batches.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    module = CausalLM(config, lr=1e-2, weight_decay=0.0)  # adds the aux losses, updates the biases
    trainer = fit(module, batches * 5, tmp_path, steps=20, enable_checkpointing=False)
    assert trainer.global_step == 20
    losses = read_metrics(tmp_path)
    first, last = losses[min(losses)], losses[max(losses)]
    assert last < 0.5 * first, losses
    biases = [m.router.expert_bias for m in module.model.modules() if isinstance(m, MoE)]
    assert all(b.abs().sum() > 0 for b in biases)  # the balancing bias moved in every MoE layer
    logged = read_metrics(tmp_path, "moe/aux_loss")
    assert sorted(logged) == sorted(losses) and all(v > 0 for v in logged.values())  # with every step's row
    assert all(0.0 <= v < 1.0 for v in read_metrics(tmp_path, "moe/dropped_frac").values())


def test_moe_meta_build_materialised_with_init_weights_equals_direct_cpu_build() -> None:
    torch.manual_seed(0)
    direct = Llama(LlamaConfig.preset("moe-tiny"))
    with torch.device("meta"):
        late = Llama(LlamaConfig.preset("moe-tiny"))
    late.to_empty(device="cpu")
    torch.manual_seed(0)
    late.init_weights()
    for (name, a), b in zip(direct.state_dict().items(), late.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_recipe_sets_router_fields_of_a_moe_preset_and_bad_ones_are_named(tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  preset: moe-tiny\n  moe:\n    aux_loss_coef: 0.02\n    top_k: 1\n")
    config = build_llama_config(load_recipe(recipe)["model"])
    assert (config.moe.aux_loss_coef, config.moe.top_k, config.moe.n_experts) == (0.02, 1, 8)
    for moe, match in [
        ({"aux_los_coef": 0.02}, r"unknown key 'model.moe.aux_los_coef'; did you mean 'aux_loss_coef'\?"),
        ({"top_k": 9}, r"top_k=9 with n_experts=8; allowed: 1..n_experts"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build_llama_config({"preset": "moe-tiny", "moe": moe})
    with pytest.raises(ConfigError, match=r"on a MoE preset \(model.preset 'tiny' is dense\)"):
        build_llama_config({"preset": "tiny", "moe": {"top_k": 1}})
