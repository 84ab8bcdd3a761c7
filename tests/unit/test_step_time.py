"""The step-time model's arithmetic against closed forms written out here (ring all-reduce 2(n-1)/n S,
reduce-scatter / all-gather (n-1)/n S, the pipeline bubble (p-1)/(v m)), its sizes against the Llama
model's own FLOP count, the link a group spans, the rates file, the search's memory filter and Young/Daly."""

import json
import math

import pytest
import torch

from strategies.plan.checkpoint_interval import effective_fraction, llama3_mtbf_s, young_daly_interval
from strategies.plan.hardware import GB, Device, Hardware, Link, Rates, build_hardware, parse_bytes
from strategies.plan.search import search
from strategies.plan.shapes import Layout, ModelShape, RunShape
from strategies.plan.step_time import dense_params, flops_per_token, step_time
from trainer.models.llama import Llama, LlamaConfig

SMALL = ModelShape(vocab_size=1000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536)


def hand_params(s: ModelShape) -> int:
    """Every weight of a dense Llama, counted by hand: per block q,o (d x d) and k,v (d x d * K/H), three FFN
    matrices and two norms; the final norm, the embedding and the output."""
    block = (
        2 * s.dim * s.dim + 2 * s.dim * s.dim * s.n_kv_heads // s.n_heads + 3 * s.dim * s.ffn_dim + 2 * s.dim
    )
    return s.n_layers * block + s.dim + 2 * s.vocab_size * s.dim


def hardware(intra: float = 100.0, inter: float = 10.0, tflops: float = 1e9, gpn: int = 8) -> Hardware:
    """A made-up machine: `intra`/`inter` GB/s busbw, a matmul rate high enough that compute is ~0."""
    return Hardware(
        Device("test", tflops, 80e9, achievable=1.0), Link("in", intra, intra), Link("out", inter, inter), gpn
    )


@pytest.mark.parametrize("preset", ["8b", "moe-tiny"])
def test_flops_per_token_is_the_llama_models_own(preset):
    config = LlamaConfig.preset(preset)
    with torch.device("meta"):
        model = Llama(config)
    moe = config.moe
    shape = ModelShape(
        vocab_size=config.vocab_size, dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads, ffn_dim=config.ffn_dim,
        n_experts=moe.n_experts if moe else 0, top_k=moe.top_k if moe else 0,
        expert_ffn_dim=moe.moe_ffn_dim if moe else 0, n_shared_experts=moe.n_shared_experts if moe else 0,
    )  # fmt: skip
    if moe is not None and moe.n_dense_layers:  # the shapes describe all-MoE stacks: compare those
        config = LlamaConfig.preset(preset, moe={**vars(moe), "n_dense_layers": 0})
        with torch.device("meta"):
            model = Llama(config)
    assert flops_per_token(shape, 1024) == model.flops_per_token(1024)


def test_dense_parameter_count_matches_a_hand_count_and_the_model():
    assert dense_params(SMALL) == hand_params(SMALL)
    config = LlamaConfig(vocab_size=1000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536)
    with torch.device("meta"):
        assert dense_params(SMALL) == sum(p.numel() for p in Llama(config).parameters())


def test_ddp_all_reduce_is_the_ring_formula_and_fully_exposed_without_compute():
    n, run = 4, RunShape(micro_batch=2, seq_len=128)
    t = step_time(SMALL, Layout(dp_replicate=n), run, hardware(intra=100.0))
    ring = 2 * (n - 1) / n * 4 * hand_params(SMALL) / (100.0 * GB)  # fp32 gradients
    assert t.comm_s["ddp"] == pytest.approx(ring)
    assert t.exposed_s["ddp"] == pytest.approx(ring + 2 * (n - 1) / n * 25e6 / (100.0 * GB), rel=1e-3)


def test_fsdp_gathers_twice_per_micro_batch_in_stage_3_once_in_stage_2_and_reduces_once():
    n, run = 8, RunShape(micro_batch=1, seq_len=128, accumulation=3)
    one = (
        (n - 1) / n * hand_params(SMALL) / (100.0 * GB)
    )  # all-gather or reduce-scatter of all weights, 1 byte
    z3 = step_time(SMALL, Layout(dp_shard=n, zero_stage=3), run, hardware())
    z2 = step_time(SMALL, Layout(dp_shard=n, zero_stage=2), run, hardware())
    assert z3.comm_s["fsdp"] == pytest.approx(2 * 3 * 2 * one + 4 * one)  # bf16 gathers, fp32 reduce
    assert z2.comm_s["fsdp"] == pytest.approx(3 * 2 * one + 4 * one)
    # with no compute to hide behind, every byte waits
    assert z3.exposed_s["fsdp"] == pytest.approx(z3.comm_s["fsdp"], rel=0.05)


def test_fsdp_hides_behind_compute_except_the_first_gather_and_last_reduce():
    slow = hardware(tflops=1e-3)  # 1 GFLOP/s: compute dwarfs every transfer
    t = step_time(SMALL, Layout(dp_shard=8), RunShape(1, 128), slow)
    unit = hand_params(SMALL) / SMALL.n_layers * 7 / 8 / (100.0 * GB)
    assert t.exposed_s["fsdp"] == pytest.approx(2 * unit + 4 * unit)
    assert t.dominant == "compute"


def test_tensor_parallel_does_four_collectives_per_block_and_six_with_full_recompute():
    tp, run = 4, RunShape(micro_batch=2, seq_len=128)
    act = 2 * 128 * SMALL.dim * 2  # one micro-batch's activations in bf16
    rs_ag = 2 * (tp - 1) / tp * act / (100.0 * GB)  # sequence parallel: reduce-scatter + all-gather
    plain = step_time(SMALL, Layout(tp=tp, sequence_parallel=True), run, hardware())
    full = step_time(
        SMALL, Layout(tp=tp, sequence_parallel=True, activation_checkpointing="full"), run, hardware()
    )
    assert plain.exposed_s["tp"] == pytest.approx(4 * SMALL.n_layers * rs_ag)
    assert full.exposed_s["tp"] == pytest.approx(6 * SMALL.n_layers * rs_ag)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_pipeline_bubble_is_p_minus_1_over_v_m_of_the_stage_work(schedule, v):
    p, m = 4, 8
    t = step_time(
        SMALL, Layout(pp=p, pp_schedule=schedule, pp_microbatches=m), RunShape(m, 128), hardware(tflops=1e-3)
    )
    assert t.exposed_s["pp bubble"] == pytest.approx(t.compute_s * (p - 1) / (v * m))


def test_a_group_that_leaves_the_node_runs_at_the_inter_node_rate():
    run = RunShape(2, 128)
    inside = step_time(SMALL, Layout(dp_replicate=8), run, hardware(intra=100.0, inter=10.0, gpn=8))
    across = step_time(SMALL, Layout(dp_replicate=16), run, hardware(intra=100.0, inter=10.0, gpn=8))
    ring = lambda n, bw: 2 * (n - 1) / n * 4 * hand_params(SMALL) / (bw * GB)  # noqa: E731
    assert inside.comm_s["ddp"] == pytest.approx(ring(8, 100.0))
    assert across.comm_s["ddp"] == pytest.approx(ring(16, 10.0))
    # tp innermost: tp=8 x dp_shard=2 keeps tp in each node and sends FSDP across
    mixed = step_time(SMALL, Layout(tp=8, dp_shard=2), run, hardware(intra=100.0, inter=10.0, gpn=8))
    per_block = dense_params(SMALL) / 8 / SMALL.n_layers
    assert mixed.comm_s["fsdp"] == pytest.approx(SMALL.n_layers * (2 * 2 + 4) * per_block / 2 / (10.0 * GB))


def test_tokens_per_s_and_mfu_follow_from_the_step():
    hw = build_hardware("h100", 8, "ib-ndr")
    run = RunShape(micro_batch=2, seq_len=4096, accumulation=4)
    t = step_time(SMALL, Layout(dp_shard=8), run, hw)
    tokens = 8 * 2 * 4096 * 4
    assert t.tokens_per_step == tokens
    assert t.tokens_per_s == pytest.approx(tokens / t.step_s)
    assert t.mfu == pytest.approx(tokens / t.step_s * flops_per_token(SMALL, 4096) / (8 * 989e12))


def write_rates(path, **changes):
    data = {
        "backend": "gloo", "device": "cpu", "world_size": 4, "gpus_per_node": 4, "matmul_tflops": 0.08,
        "links": {"intra_node": {"busbw_GBps": 1.1, "nominal_GBps": None},
                  "inter_node": {"busbw_GBps": 1.1, "nominal_GBps": None}},
        "collectives": {"all_reduce": {"world": {"1048576": 0.5, "16777216": 1.0}}},
    }  # fmt: skip
    data.update(changes)
    path.write_text(json.dumps(data))
    return path


def test_rates_interpolate_busbw_in_log_size_and_replace_the_table(tmp_path):
    rates = Rates.read(write_rates(tmp_path / "rates.json"))
    assert rates.busbw("all_reduce", "tp", 4194304) == pytest.approx(0.75)  # halfway in log2: 2^22
    assert rates.busbw("all_reduce", "world", 1) == 0.5 and rates.busbw("all_reduce", "world", 1e12) == 1.0
    assert rates.busbw("all_gather", "world", 1e6) is None
    hw = build_hardware("h100", 4, rates=rates)
    assert hw.flops_per_s == pytest.approx(0.08e12)
    assert hw.busbw("all_reduce", "dp_replicate", 4194304, inter_node=False) == pytest.approx(0.75 * GB)
    assert hw.busbw("all_gather", "dense", 1e6, inter_node=True) == pytest.approx(1.1 * GB)  # the link's


def test_a_bad_rates_file_and_bad_names_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="matmul_tflops"):
        Rates.read(write_rates(tmp_path / "r.json", matmul_tflops="fast"))
    with pytest.raises(ValueError, match="device 'h900' is unknown; allowed: h100"):
        build_hardware("h900")
    with pytest.raises(ValueError, match="link 'ib' is unknown"):
        build_hardware("h100", link="ib")
    assert parse_bytes("80GB") == 80e9 and parse_bytes("1 GiB") == 2**30
    with pytest.raises(ValueError, match="memory size 'lots'"):
        parse_bytes("lots")


def weights_only(shape, layout, run):
    """16 bytes a parameter split over every rank that holds a part (a stand-in memory model)."""
    sharded = layout.tp * layout.pp * (layout.dp_shard * layout.cp if layout.dp_shard > 1 else 1)

    class Estimate:
        peak = 16 * dense_params(shape) / sharded

    return Estimate()


def test_search_keeps_only_layouts_that_fit_and_ranks_by_tokens_per_s():
    hw = build_hardware("h100", 8, "ib-ndr", gpu_memory=40e9)
    shape = ModelShape(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=11008)
    plan = search(shape, hw, 8, 4096, 32, memory=weights_only)  # ~7B: 108 GB of state, fits only split
    speeds = [c.time.tokens_per_s for c in plan.ranked]
    assert speeds[1:] == sorted(speeds[1:], reverse=True), "fastest first, after the winner"
    assert speeds[0] >= 0.98 * max(speeds), "the winner is within 2% of the fastest (simpler on a near-tie)"
    assert all(c.peak_bytes <= 40e9 * 0.9 for c in plan.ranked) and plan.too_big > 0
    assert all(c.layout.dp_replicate < 8 for c in plan.ranked), "plain DDP holds 108 GB per GPU"
    with pytest.raises(ValueError, match="no layout of 2 GPUs fits in 40 GB per GPU"):
        search(shape, hw, 2, 4096, 32, memory=weights_only)


def test_young_daly_interval_and_llama3_failure_rate():
    assert young_daly_interval(60.0, 86400.0) == pytest.approx(math.sqrt(2 * 60 * 86400))
    assert llama3_mtbf_s(16384) == pytest.approx(54 * 86400 / 466)  # one interruption per ~2.8 h
    assert llama3_mtbf_s(8192) == pytest.approx(2 * llama3_mtbf_s(16384))
    best = young_daly_interval(60.0, 86400.0)
    assert effective_fraction(60.0, best, 86400.0) > effective_fraction(60.0, best / 2, 86400.0)
    assert effective_fraction(60.0, best, 86400.0) > effective_fraction(60.0, best * 2, 86400.0)
    with pytest.raises(ValueError, match="gpus=0 is invalid"):
        llama3_mtbf_s(0)
