"""The step-time model's arithmetic against closed forms written out here (ring all-reduce 2(n-1)/n S,
reduce-scatter / all-gather (n-1)/n S, the pipeline bubble (p-1)/(v m)), its sizes against the Llama
model's own FLOP count, the link a group spans, the rates file, the search's memory filter and Young/Daly."""

import json
import math
from dataclasses import replace

import pytest
import torch

from strategies.plan.checkpoint_interval import effective_fraction, llama3_mtbf_s, young_daly_interval
from strategies.plan.hardware import (
    GB,
    Device,
    Hardware,
    Link,
    Rates,
    build_hardware,
    measured_hardware,
    parse_bytes,
)
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


def test_tensor_parallel_does_four_collective_pairs_per_block_six_with_full_recompute_and_two_outside():
    tp, run = 4, RunShape(micro_batch=2, seq_len=128)
    act = 2 * 128 * SMALL.dim * 2  # one micro-batch's activations in bf16
    rs_ag = 2 * (tp - 1) / tp * act / (100.0 * GB)  # sequence parallel: reduce-scatter + all-gather
    plain = step_time(SMALL, Layout(tp=tp, sequence_parallel=True), run, hardware())
    full = step_time(
        SMALL, Layout(tp=tp, sequence_parallel=True, activation_checkpointing="full"), run, hardware()
    )
    assert plain.exposed_s["tp"] == pytest.approx((4 * SMALL.n_layers + 2) * rs_ag)
    assert full.exposed_s["tp"] == pytest.approx((6 * SMALL.n_layers + 2) * rs_ag)
    staged = step_time(SMALL, Layout(tp=tp, pp=2, pp_microbatches=2, sequence_parallel=True), run, hardware())
    assert staged.exposed_s["tp"] == pytest.approx(2 * (4 * SMALL.n_layers // 2 + 1) * rs_ag / 2)


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
    # a rate the model divides by: zero or negative is refused by its key, not a ZeroDivisionError later
    with pytest.raises(ValueError, match=r"matmul_tflops_by_size\.1024 is 0\.0, not a positive rate"):
        Rates.read(write_rates(tmp_path / "r.json", matmul_tflops_by_size={"256": 0.05, "1024": 0}))
    with pytest.raises(ValueError, match=r"collectives\.all_reduce\.world\.1048576 is -0\.5, not a positive"):
        Rates.read(write_rates(tmp_path / "r.json", collectives={"all_reduce": {"world": {"1048576": -0.5}}}))
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


def hockney_rates(alpha_step: float, busbw: float, n: int = 2, **changes) -> Rates:
    """Rates whose all-gather over `n` ranks took exactly steps * alpha_step + S (n-1)/n / busbw at each size."""
    factor = (n - 1) / n
    table = {}
    for size in (4096, 65536, 1048576, 8388608):
        seconds = (n - 1) * alpha_step + size * factor / (busbw * GB)
        table[str(size)] = size * factor / seconds / GB  # the busbw the doctor prints
    data = {
        "backend": "gloo", "device": "cpu", "world_size": n, "gpus_per_node": n, "matmul_tflops": 0.1,
        "links": {"intra_node": {"busbw_GBps": busbw, "nominal_GBps": None}},
        "collectives": {"all_gather": {"world": table}}, "group_ranks": {"world": n},
    }  # fmt: skip
    data.update(changes)
    return Rates.from_dict(data)


def test_measured_collectives_split_into_a_fixed_cost_per_ring_step_and_a_bandwidth():
    rates = hockney_rates(alpha_step=200e-6, busbw=1.0, n=4)
    step_s, busbw = rates.latency_bandwidth("all_gather", "tp")  # no tp group measured: the world's
    assert step_s == pytest.approx(200e-6) and all(bw == pytest.approx(1.0) for bw in busbw.values())
    hw = measured_hardware(rates, 4e9)
    # 8 ranks: twice-and-a-bit the steps of the 4 measured; a tiny message pays the steps, a big one the bytes
    assert hw.collective_s("all_gather", "dense", 8, 8, False) == pytest.approx(7 * 200e-6 + 8 * 7 / 8 / GB)
    assert hw.collective_s("all_gather", "dense", 1e9, 8, False) == pytest.approx(7 * 200e-6 + 7 / 8)
    assert hw.collective_s("all_gather", "dense", 1e9, 1, False) == 0.0


def test_table_links_charge_nccl_latencies_per_ring_step():
    hw = build_hardware("h100", 8, "ib-ndr")
    small = hw.collective_s("all_reduce", "tp", 8, 8, inter_node=False)
    assert 10e-6 <= small <= 30e-6, "one NVLink node: nccl-tests' small all-reduce takes ~10-20 us"
    across = hw.collective_s("all_gather", "dense", 8, 64, inter_node=True)
    assert across == pytest.approx(63 * 5e-6, rel=1e-3), "a 64-rank ring across IB: 63 hops"


def test_many_small_tensor_parallel_collectives_pay_their_latency():
    run = RunShape(micro_batch=2, seq_len=128)
    layout = Layout(tp=2, sequence_parallel=True)
    act = 2 * 128 * SMALL.dim * 2
    fast = step_time(SMALL, layout, run, measured_hardware(hockney_rates(0.0, 1.0), 4e9))
    slow = step_time(SMALL, layout, run, measured_hardware(hockney_rates(1e-3, 1.0), 4e9))
    collectives = 2 * (4 * SMALL.n_layers + 2)  # reduce-scatter + all-gather, 4 times per block, 2 outside
    assert fast.comm_s["tp"] == pytest.approx(collectives * act / 2 / GB, rel=1e-3)
    # only the all-gathers were measured: the reduce-scatters fall back to the link (no latency)
    assert slow.comm_s["tp"] - fast.comm_s["tp"] == pytest.approx(collectives / 2 * 1e-3, rel=1e-3)


def test_small_matmuls_and_ranks_sharing_a_host_slow_the_compute():
    sizes = {"64": 0.025, "256": 0.05, "1024": 0.1}  # TFLOP/s: a quarter of the large rate at n = 64
    rates = hockney_rates(0.0, 1.0, matmul_tflops_by_size=sizes, matmul_together_tflops=0.08, host_cores=2)
    hw = measured_hardware(rates, 4e9)
    assert hw.matmul_rate(1024) == pytest.approx(0.1e12) and hw.matmul_rate(128) == pytest.approx(0.0375e12)
    assert hw.matmul_rate(16) == pytest.approx(0.025e12), "held flat below the smallest size measured"
    assert hw.sharing(1) == 1.0 and hw.sharing(2) == pytest.approx(0.8)
    run = RunShape(micro_batch=2, seq_len=128)
    one = step_time(SMALL, Layout(precision="fp32"), run, hw)
    split = step_time(SMALL, Layout(tp=2, precision="fp32"), run, hw)
    # tp halves each rank's FLOPs, but its halved matmuls run slower and two ranks share the host
    assert one.compute_s / 2 / 0.8 < split.compute_s < one.compute_s
    # MFU against the fastest size measured: here the largest, below it when a mid size runs faster
    assert one.mfu == pytest.approx(one.tokens_per_s * flops_per_token(SMALL, 128) / 0.1e12)
    bumpy = hockney_rates(0.0, 1.0, matmul_tflops_by_size={**sizes, "256": 0.125})
    fast_mid = step_time(SMALL, Layout(precision="fp32"), run, measured_hardware(bumpy, 4e9))
    assert fast_mid.mfu == pytest.approx(fast_mid.tokens_per_s * flops_per_token(SMALL, 128) / 0.125e12)
    flat = step_time(
        SMALL, Layout(tp=2, precision="fp32"), run, measured_hardware(hockney_rates(0.0, 1.0), 4e9)
    )
    assert flat.compute_s == pytest.approx(
        run.micro_batch * run.seq_len * flops_per_token(SMALL, 128) / 2 / 0.1e12
    ), "one measured size: every matmul at the doctor's rate"


def test_on_a_cpu_host_without_a_spare_core_nothing_hides_behind_compute():
    run = RunShape(micro_batch=2, seq_len=128)
    spare = measured_hardware(hockney_rates(0.0, 1.0, host_cores=8, matmul_tflops=1e-4), 4e9)
    busy = measured_hardware(hockney_rates(0.0, 1.0, host_cores=2, matmul_tflops=1e-4), 4e9)
    assert spare.overlap(2) == 1.0 and busy.overlap(2) == 0.0 and busy.overlap(1) == pytest.approx(1.0)
    for layout, name in ((Layout(dp_replicate=2), "ddp"), (Layout(dp_shard=2, zero_stage=3), "fsdp")):
        hidden = step_time(SMALL, layout, run, spare)
        exposed = step_time(SMALL, layout, run, busy)
        assert hidden.exposed_s[name] < 0.5 * hidden.comm_s[name], name  # slow compute hides most of it
        assert exposed.exposed_s[name] == pytest.approx(exposed.comm_s[name]), name


def test_a_pipeline_fills_and_drains_at_the_rate_of_a_rank_alone():
    # 2 stages, 2 micro-batches of 1F1B: the bubble is half a stage's work, and while one
    # stage idles the other has the host to itself
    rates = hockney_rates(0.0, 1e6, matmul_together_tflops=0.08)  # 0.8 of 0.1 alone when both compute
    hw = measured_hardware(rates, 4e9)
    run = RunShape(micro_batch=2, seq_len=128)
    t = step_time(SMALL, Layout(pp=2, pp_microbatches=2, precision="fp32"), run, hw)
    alone = run.micro_batch * run.seq_len * flops_per_token(SMALL, 128) / 2 / 0.1e12
    assert t.compute_s == pytest.approx(alone / 2 + alone / 2 / 0.8)
    assert t.exposed_s["pp bubble"] == pytest.approx(alone / 2)


def test_tensor_parallel_host_time_adds_per_block_and_pass_on_a_cpu_host_and_hides_on_a_gpu():
    run = RunShape(micro_batch=2, seq_len=128, accumulation=3)
    timed = {"tp_block_s": 0.01, "tp_pass_s": 0.004, "tp_step_block_s": 0.002, "tp_step_s": 0.005}
    plain = measured_hardware(hockney_rates(0.0, 1.0, host_cores=2), 4e9)
    cpu = measured_hardware(hockney_rates(0.0, 1.0, host_cores=2, **timed), 4e9)
    gpu = measured_hardware(hockney_rates(0.0, 1.0, **timed), 4e9)  # no host cores: a GPU's host
    tp = Layout(tp=2, precision="fp32")
    base, added = step_time(SMALL, tp, run, plain), step_time(SMALL, tp, run, cpu)
    step = 0.002 * SMALL.n_layers + 0.005  # the optimizer step and clip on DTensor parameters, once a step
    host = 3 * (0.01 * SMALL.n_layers + 0.004) + step  # 3 passes a step
    assert "tp host" not in base.exposed_s and added.exposed_s["tp host"] == pytest.approx(host)
    assert added.step_s == pytest.approx(base.step_s + host)
    full = step_time(SMALL, Layout(tp=2, precision="fp32", activation_checkpointing="full"), run, cpu)
    assert full.exposed_s["tp host"] == pytest.approx(3 * (0.01 * SMALL.n_layers * 4 / 3 + 0.004) + step)
    stages = step_time(SMALL, Layout(tp=2, pp=2, pp_microbatches=2, precision="fp32"), run, cpu)
    per_stage = SMALL.n_layers // 2  # a stage steps its own blocks' parameters
    assert stages.exposed_s["tp host"] == pytest.approx(
        6 * (0.01 * per_stage + 0.004) + 0.002 * per_stage + 0.005
    )
    assert step_time(SMALL, tp, run, gpu).exposed_s["tp host"] == pytest.approx(max(host - base.compute_s, 0))
    assert base.compute_s > host, "here the GPU's kernels outlast the host's bookkeeping: all of it hides"
    assert "tp host" not in step_time(SMALL, Layout(dp_replicate=2), run, cpu).exposed_s


def test_fsdp_host_time_adds_per_block_pass_and_step_where_fsdp_shards():
    run = RunShape(micro_batch=2, seq_len=128, accumulation=3)
    timed = {"fsdp_block_s": 0.02, "fsdp_pass_s": 0.01, "fsdp_step_block_s": 0.003, "fsdp_step_s": 0.004}
    plain = measured_hardware(hockney_rates(0.0, 1.0, host_cores=2), 4e9)
    cpu = measured_hardware(hockney_rates(0.0, 1.0, host_cores=2, **timed), 4e9)
    fsdp = Layout(dp_shard=2, zero_stage=3, precision="fp32")
    base, added = step_time(SMALL, fsdp, run, plain), step_time(SMALL, fsdp, run, cpu)
    host = 3 * (0.02 * SMALL.n_layers + 0.01) + 0.003 * SMALL.n_layers + 0.004  # 3 passes, 1 step
    assert "fsdp host" not in base.exposed_s and added.exposed_s["fsdp host"] == pytest.approx(host)
    assert added.step_s == pytest.approx(base.step_s + host)
    for other in (Layout(dp_replicate=2), Layout(tp=2), Layout(dp_shard=2, zero_stage=1)):
        assert "fsdp host" not in step_time(SMALL, other, run, cpu).exposed_s, other  # no FSDP there


def test_a_rates_file_whose_sharding_time_is_not_a_number_is_refused_by_name():
    with pytest.raises(ValueError, match="fsdp_step_s is 'abc', not a number"):
        hockney_rates(0.0, 1.0, fsdp_step_s="abc")
    assert hockney_rates(0.0, 1.0, tp_block_s=0.01).sharded == {"tp": {"block_s": 0.01}, "fsdp": {}}


def test_a_gpu_hides_the_shardings_host_time_together_behind_its_kernels():
    # tp x FSDP on a GPU: each sharding's host time alone fits under the kernels, both together do not
    run = RunShape(micro_batch=2, seq_len=128)
    both = Layout(tp=2, dp_shard=2, zero_stage=3, precision="fp32")
    compute = step_time(SMALL, both, run, measured_hardware(hockney_rates(0.0, 1.0, n=4), 4e9)).compute_s
    per_block = 0.6 * compute / SMALL.n_layers  # 0.6 of the kernels' time each
    timed = {"tp_block_s": per_block, "fsdp_block_s": per_block}
    gpu = measured_hardware(hockney_rates(0.0, 1.0, n=4, **timed), 4e9)  # no host cores: a GPU's host
    waits = step_time(SMALL, both, run, gpu).exposed_s
    assert waits["tp host"] + waits["fsdp host"] == pytest.approx(0.2 * compute)
    assert waits["tp host"] == pytest.approx(waits["fsdp host"])


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_the_bubble_share_of_a_shared_host_runs_alone_one_v_th_as_long_interleaved(schedule, v):
    # 2 stages, 2 micro-batches: the bubble is (p-1)/(v m) of a stage's work, 1/2 in 1F1B and 1/4 with two
    # stages per rank interleaved; during it the rank has the host to itself, the rest runs at 0.8 of alone
    p, m = 2, 2
    hw = measured_hardware(hockney_rates(0.0, 1e6, matmul_together_tflops=0.08), 4e9)
    run = RunShape(micro_batch=m, seq_len=128)
    layout = Layout(pp=p, pp_schedule=schedule, pp_microbatches=m, precision="fp32")
    t = step_time(SMALL, layout, run, hw)
    alone = run.micro_batch * run.seq_len * flops_per_token(SMALL, 128) / p / 0.1e12
    bubble = (p - 1) / (v * m)
    assert t.compute_s == pytest.approx(alone * bubble + alone * (1 - bubble) / 0.8)
    assert t.exposed_s["pp bubble"] == pytest.approx(alone * bubble)


def test_sequence_parallel_sends_a_tp_th_of_the_activations_between_stages():
    # 2 stages of tp=2, 2 micro-batches of one 128-token sequence: each crossing moves that micro-batch's
    # activations (bf16) forward and their gradient back; sequence parallelism leaves each tp rank its
    # shard of the sequence to send
    tp, run = 2, RunShape(micro_batch=2, seq_len=128)
    activations = 1 * 128 * SMALL.dim * 2
    for sp, sent in ((False, activations), (True, activations / tp)):
        t = step_time(SMALL, Layout(tp=tp, pp=2, pp_microbatches=2, sequence_parallel=sp), run, hardware())
        # a send of s bytes costs a 2-rank all-gather of 2s: (2-1)/2 x 2s at 100 GB/s; twice per micro-batch
        assert t.comm_s["pp p2p"] == pytest.approx(2 * 2 * sent / (100.0 * GB)), sp


def test_zero3_per_linear_moves_a_blocks_bytes_in_one_collective_per_weight():
    # DeepSpeed's ZeRO-3 (fsdp_unit "linear") gathers each of a block's 7 weights on its own: the same bytes
    # as one gather of the block, each of the 7 collectives paying the ring's latency
    link = Link("made-up", 10.0, 10.0, latency_us=5.0)
    hw = Hardware(Device("x", 1e9, 1e12, achievable=1.0), link, link, 8)
    layout, run = Layout(dp_shard=16), RunShape(1, 64)
    block = step_time(SMALL, layout, run, hw).comm_s["fsdp"]
    linear = step_time(SMALL, replace(layout, fsdp_unit="linear"), run, hw).comm_s["fsdp"]
    collectives = SMALL.n_layers * 3  # per block: gathered forward and backward, reduce-scattered
    assert linear - block == pytest.approx(collectives * (7 - 1) * 15 * 5e-6)
