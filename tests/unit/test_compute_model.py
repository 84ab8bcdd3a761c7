"""The physical compute model (strategies/plan/compute.py, hardware.py's Device.gemm_rate) and the pipeline
and context-parallel choices it opens (search.py): a small matmul is slower than a large one, tp and cp cost
efficiency, flash attention and the eager kernels cost time, v stages per rank shrink the bubble, and the
search says which constraint left nothing to try."""

import pytest

from strategies.plan.compute import EAGER_PASSES, attention_s, elementwise_bytes, recomputed_forward
from strategies.plan.hardware import DEVICES, GB, build_hardware, power_limited_share
from strategies.plan.search import layouts, runs_microbatches, search
from strategies.plan.shapes import Layout, ModelShape, RunShape
from strategies.plan.step_time import recompute_flops_per_token, step_time, weight_matmuls

GPT_1_7B = ModelShape(51200, 2304, 24, 24, 24, 6144, tie_embeddings=True)
LLAMA3_8B = ModelShape(128256, 4096, 32, 32, 8, 14336)
SMALL = ModelShape(vocab_size=1024, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536)


def no_memory(shape, layout, run):
    return type("M", (), {"peak": 0.0})()


@pytest.mark.parametrize("name", ["a100", "h100", "b200"])
def test_a_small_matmul_runs_below_a_large_one_and_never_above_the_roofline(name):
    d = DEVICES[name]
    rates = [d.gemm_rate(n) for n in (128, 512, 2048, 8192, 32768)]
    assert rates == sorted(rates) and rates[0] < 0.1 * rates[-1]
    assert rates[-1] <= d.gemm_max * d.bf16_tflops * 1e12
    assert d.gemm_rate(64) <= d.hbm_GBps * GB * 64 / 3, "below the ridge the HBM bandwidth bounds it"


def test_tensor_parallel_shrinks_the_matmuls_and_costs_efficiency():
    hw = build_hardware("h100")
    run = RunShape(1, 2048)
    one = step_time(GPT_1_7B, Layout(), run, hw).compute_s
    split = step_time(GPT_1_7B, Layout(tp=8, sequence_parallel=True), run, hw).compute_s
    assert split * 8 > 1.3 * one, (
        "8 ranks on an eighth of each matmul each take more than an eighth of the time"
    )


def test_eager_kernels_move_more_bytes_than_fused_ones_and_take_longer():
    hw = build_hardware("h100")
    run = RunShape(2, 4096)
    eager, fused = Layout(), Layout(fused_kernels=True)
    assert elementwise_bytes(GPT_1_7B, eager, 1000) == pytest.approx(
        EAGER_PASSES * elementwise_bytes(GPT_1_7B, fused, 1000)
    )
    assert step_time(GPT_1_7B, eager, run, hw).step_s > step_time(GPT_1_7B, fused, run, hw).step_s


def test_context_parallel_is_not_chosen_for_2k_token_sequences():
    plan = search(GPT_1_7B, build_hardware("h100"), 8, 2048, 64, memory=no_memory)
    assert plan.best.layout.cp == 1, plan.why


def test_mfu_of_a_large_model_is_in_the_published_range_and_below_the_gemm_ceiling():
    # Megatron-LM's 145.6B on 1536 A100 (t8 p8, full recompute): 47% of peak with recompute, ~36% MFU
    shape = ModelShape(51200, 12288, 80, 96, 96, 32768, tie_embeddings=True)
    layout = Layout(dp_replicate=24, tp=8, pp=8, sequence_parallel=True, pp_schedule="interleaved_1f1b",
                    pp_microbatches=96, activation_checkpointing="full", fused_kernels=True)  # fmt: skip
    mfu = step_time(shape, layout, RunShape(96, 2048), build_hardware("a100", link="ib-hdr")).mfu
    assert 0.3 < mfu < DEVICES["a100"].gemm_max


@pytest.mark.parametrize("v", [2, 4, 8])
def test_v_stages_per_rank_divide_the_bubble(v):
    hw = build_hardware("h100")
    base = dict(pp=4, pp_microbatches=8, pp_schedule="interleaved_1f1b")
    t = step_time(SMALL, Layout(**base, pp_virtual_stages=v), RunShape(8, 1024), hw)
    one = step_time(SMALL, Layout(pp=4, pp_microbatches=8), RunShape(8, 1024), hw)
    assert t.exposed_s["pp bubble"] == pytest.approx(one.exposed_s["pp bubble"] / v, rel=0.05)


def test_llama3s_relaxed_micro_batch_rule_is_torchs_flexible_interleaving():
    assert runs_microbatches("interleaved_1f1b", 16, 20) and runs_microbatches("interleaved_1f1b", 16, 8)
    assert runs_microbatches("interleaved_1f1b", 4, 10) and not runs_microbatches("interleaved_1f1b", 4, 9)
    assert runs_microbatches("1f1b", 4, 6) and not runs_microbatches("1f1b", 16, 8)


def test_the_search_weighs_more_stages_per_rank_only_when_asked():
    found = {L.stages_per_rank for L, _ in layouts(SMALL, 8, 8, 1024, 16) if L.pp > 1}
    wider = {L.stages_per_rank for L, _ in layouts(SMALL, 8, 8, 1024, 16, virtual_stages=(2, 4)) if L.pp > 1}
    assert found == {1, 2} and wider == {1, 2, 4}


def test_context_parallel_spans_nodes_over_the_inter_node_link():
    cps = {L.cp for L, _ in layouts(SMALL, 32, 8, 4096, 32)}
    assert 16 in cps, "cp is not capped at one node"
    hw = build_hardware("h100", gpus_per_node=8)
    run = RunShape(1, 4096)
    inside = step_time(SMALL, Layout(cp=8, dp_shard=2, zero_stage=2), run, hw).comm_s["cp"]
    across = step_time(SMALL, Layout(cp=16, zero_stage=2), run, hw).comm_s["cp"]
    assert across > 2 * inside


def test_nothing_to_try_names_the_constraint_that_bit():
    with pytest.raises(ValueError, match="micro-batches do not fill pp=2"):
        search(SMALL, build_hardware("h100"), 2, 1024, 1, memory=no_memory,
               keep=lambda L, run: L.pp == 2 and L.pp_schedule == "1f1b")  # fmt: skip


def test_megatrons_published_gpt_1_7b_layout_ranks_near_the_best_with_its_checkpointing():
    # Narayanan et al. 2021, Table 1: 1.7B on 32 A100, t1 p1 (data parallel only), full recompute, 137 TFLOP/s
    hw = build_hardware("a100", link="ib-hdr")
    kernels = {"fused_kernels": True, "flash_attention": False}
    plan = search(
        GPT_1_7B, hw, 32, 2048, 512, kernels=kernels, keep=lambda L, run: L.activation_checkpointing == "full"
    )
    published = [
        c for c in plan.ranked if c.layout.tp == c.layout.pp == c.layout.cp == 1 and c.layout.dp_shard == 1
    ]
    assert published and published[0].time.tokens_per_s >= 0.95 * plan.best.time.tokens_per_s
    assert 0.3 < published[0].time.mfu < 0.4, "the published 44% of peak with recompute is ~34% MFU"


def test_the_500w_hbm2e_h100_runs_at_its_power_limited_clock_and_its_mfu_is_over_the_sxm_peak():
    # TorchTitan's H100s (96 GB HBM2e at 2.4 TB/s, 500 W): compute-bound matmuls at the SXM part's rate times
    # the clock 500 W sustains, memory-bound ones at the HBM2e bandwidth; MFU over the SXM's 989 TFLOP/s
    slow, sxm = DEVICES["h100-hbm2e-500w"], DEVICES["h100"]
    assert slow.clock_share == pytest.approx(power_limited_share(500, 700)) and 0.85 < slow.clock_share < 0.95
    assert power_limited_share(400, 700) * 989 == pytest.approx(835, rel=0.02), "the H100 NVL's datasheet"
    huge = 1e7  # past every ridge: the efficiency curve saturates on both
    assert slow.gemm_rate(huge) / sxm.gemm_rate(huge) == pytest.approx(slow.clock_share, rel=1e-3)
    assert slow.ridge == pytest.approx(3 * 989e12 * slow.clock_share / (2400 * GB)) and slow.ridge > sxm.ridge
    assert slow.gemm_rate(64) < slow.hbm_GBps * GB * 64 / 3 < sxm.hbm_GBps * GB * 64 / 3
    assert build_hardware("h100-hbm2e-500w").peak_flops_per_s == 989e12
    run, layout = RunShape(2, 8192), Layout(dp_shard=8, activation_checkpointing="selective_op")
    fast = step_time(LLAMA3_8B, layout, run, build_hardware("h100"))
    limited = step_time(LLAMA3_8B, layout, run, build_hardware("h100-hbm2e-500w"))
    assert fast.mfu * slow.clock_share > limited.mfu, "the matmuls slow with the clock, the norms with HBM2e"


def test_torchtitans_op_policy_reruns_the_forward_of_every_second_matmul():
    # wk, wo and w3 of each block forward again, by FLOPs what step_time's count adds for it; nothing of the
    # output layer; the attention kernel's output is kept (not rerun), the project's selective reruns it
    hw, tokens = build_hardware("h100"), 16384.0
    plain, op = Layout(dp_shard=8), Layout(dp_shard=8, activation_checkpointing="selective_op")
    found = weight_matmuls(LLAMA3_8B, op, tokens)
    extra = sum(
        f * share / 3 for (f, *_), share in zip(found, recomputed_forward(op, len(found)), strict=True)
    )
    assert extra == pytest.approx(tokens * recompute_flops_per_token(LLAMA3_8B, 8192, "selective_op"))
    assert attention_s(LLAMA3_8B, op, tokens, 8192, hw) == attention_s(LLAMA3_8B, plain, tokens, 8192, hw)
    selective = Layout(dp_shard=8, activation_checkpointing="selective")
    assert attention_s(LLAMA3_8B, selective, tokens, 8192, hw) > attention_s(
        LLAMA3_8B, plain, tokens, 8192, hw
    )
