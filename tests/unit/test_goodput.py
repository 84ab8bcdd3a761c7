"""The goodput projection's formulas (strategies/plan/goodput.py) at their limits, their orderings, and at
Llama 3's failure rate; the checkpoint size and replica group it reads off a planned layout."""

from dataclasses import replace

import pytest

from strategies.plan.checkpoint_interval import llama3_mtbf_s
from strategies.plan.goodput import (
    Costs,
    break_even_ratio,
    checkpoint_every_s,
    live_goodput,
    restart_goodput,
    seed_mtbf_s,
)
from strategies.plan.hardware import GB
from strategies.plan.replica_group import checkpoint_bytes, smallest_group
from strategies.plan.shapes import Layout, ModelShape, RunShape
from strategies.plan.step_time import dense_params

# Llama 3 405B's state (12 bytes a parameter) on 2,048 nodes at 1 GB/s each, a 10-minute relaunch, the
# project's measured torchft costs, 16 replica groups of 1,024 GPUs
COSTS = Costs(
    step_s=7.4, save_s=2.4, restore_s=2.4, restart_s=600.0, stall_s=5.1, rejoin_s=3.7, replace_s=600.0,
    step_ratio=1.0, groups=16,
)  # fmt: skip
NEVER = 1e15  # an MTBF of 30 million years: no failures


def test_without_failures_every_way_keeps_all_its_time_but_the_per_step_cost():
    assert restart_goodput(COSTS, NEVER) == pytest.approx(1.0, abs=1e-6)
    assert live_goodput(COSTS, NEVER) == pytest.approx(1.0, abs=1e-12)
    assert live_goodput(COSTS, NEVER, spares=True) == pytest.approx(1.0, abs=1e-12)
    assert live_goodput(replace(COSTS, step_ratio=1.25), NEVER) == pytest.approx(0.8, abs=1e-12)


def test_restart_goodput_falls_as_the_job_grows():
    values = [restart_goodput(COSTS, llama3_mtbf_s(n)) for n in (1024, 4096, 16384, 65536, 100_000)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False)), values
    live = [live_goodput(COSTS, llama3_mtbf_s(n)) for n in (1024, 16384, 100_000)]
    assert all(a > b for a, b in zip(live, live[1:], strict=False)), live


def test_spares_never_lose_to_live_recovery_and_live_beats_restart_at_no_per_step_cost():
    for gpus in (1024, 16384, 100_000):
        mtbf = llama3_mtbf_s(gpus)
        spares, live, restart = (
            live_goodput(COSTS, mtbf, spares=True), live_goodput(COSTS, mtbf), restart_goodput(COSTS, mtbf)
        )  # fmt: skip
        assert spares >= live > restart, (gpus, spares, live, restart)
        # the group's wait is shared by the groups: more of them, less lost
        assert live_goodput(replace(COSTS, groups=128), mtbf) > live


def test_live_recovery_whose_every_failure_takes_every_group_is_restart_from_checkpoint():
    everything = replace(COSTS, job_wide=1.0)
    for gpus in (1024, 16384, 100_000):
        mtbf = llama3_mtbf_s(gpus)
        assert live_goodput(everything, mtbf) == pytest.approx(restart_goodput(COSTS, mtbf), abs=1e-12)
    half = live_goodput(replace(COSTS, job_wide=0.5), llama3_mtbf_s(16384))
    assert restart_goodput(COSTS, llama3_mtbf_s(16384)) < half < live_goodput(COSTS, llama3_mtbf_s(16384))


def test_the_numbers_at_llama_3s_rate():
    mtbf = llama3_mtbf_s(16384)
    assert mtbf == pytest.approx(54 * 86400 / 466)  # 2.78 h
    assert llama3_mtbf_s(100_000) / 60 == pytest.approx(27.3, abs=0.05), "the seed's 'half an hour', nearly"
    assert seed_mtbf_s(100_000) == 1800.0 and seed_mtbf_s(50_000) == 3600.0
    interval = checkpoint_every_s(COSTS, mtbf)
    assert interval == pytest.approx((2 * 2.4 * mtbf) ** 0.5)  # Young/Daly: 219 s
    # 1 - C/T - (T/2 + R + restore)/M: 1.1% saving, 1.1% redone, 6.0% restarting -> Llama 3's "> 90%"
    restart = restart_goodput(COSTS, mtbf)
    assert restart == pytest.approx(1 - 2.4 / interval - (interval / 2 + 602.4) / mtbf)
    assert 0.90 < restart < 0.93
    # live: stall 5.1 + the dropped 7.4 s step + (600 + 3.7) / 16 of the throughput: 0.5% lost
    live = live_goodput(COSTS, mtbf)
    assert live == pytest.approx(1 - (5.1 + 7.4 + 603.7 / 16) / mtbf)
    assert live_goodput(replace(COSTS, step_ratio=1.02), mtbf) > 0.95 > restart
    assert live_goodput(replace(COSTS, step_ratio=1.14), mtbf) < restart, "the measured 1.14x does not pay"


def test_the_break_even_ratio_is_where_live_recovery_meets_its_target():
    mtbf = llama3_mtbf_s(16384)
    for target in (0.95, restart_goodput(COSTS, mtbf)):
        ratio = break_even_ratio(COSTS, mtbf, target)
        assert ratio > 1
        assert live_goodput(replace(COSTS, step_ratio=ratio), mtbf) == pytest.approx(target, abs=1e-12)


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^step_ratio=0.9 is invalid; allowed: a finite number >= 1$"):
        replace(COSTS, step_ratio=0.9)
    with pytest.raises(ValueError, match=r"^job_wide=1.5 is invalid; allowed: a share from 0 to 1$"):
        replace(COSTS, job_wide=1.5)
    with pytest.raises(ValueError, match=r"^step_s=0.0 is invalid; allowed: a finite number of seconds > 0$"):
        replace(COSTS, step_s=0.0)
    with pytest.raises(ValueError, match=r"^groups=1: live recovery needs a surviving group; allowed: >= 2$"):
        live_goodput(replace(COSTS, groups=1), 3600.0)
    with pytest.raises(ValueError, match=r"^gpus=0 is invalid"):
        seed_mtbf_s(0)


LLAMA_70B = ModelShape(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672)
TP8_FSDP64 = Layout(dp_shard=64, tp=8, sequence_parallel=True, activation_checkpointing="selective")
RUN = RunShape(
    micro_batch=2, seq_len=8192, accumulation=2
)  # `trainer plan recipes/llama_70b.yaml --gpus 512`


def test_the_checkpoint_is_one_copy_of_the_weights_and_adamw_state():
    size = checkpoint_bytes(LLAMA_70B, TP8_FSDP64, RUN)
    assert size == pytest.approx(12 * dense_params(LLAMA_70B), rel=0.005)  # FSDP's padding on top
    replicated = replace(TP8_FSDP64, dp_shard=16, dp_replicate=4)
    assert checkpoint_bytes(LLAMA_70B, replicated, RUN) == pytest.approx(size, rel=0.005), "one copy"
    offloaded = replace(TP8_FSDP64, cpu_offload=True)
    assert checkpoint_bytes(LLAMA_70B, offloaded, RUN) == size, "the host's copy is saved all the same"


def test_the_smallest_replica_group_is_the_fsdp_cut_that_fits_and_at_least_a_node():
    group = smallest_group(LLAMA_70B, TP8_FSDP64, RUN, 80 * GB, 8)
    # the memory model: 147.8 GB a GPU unsharded, 94.9 GB over 2, 68.5 GB over 4 (<= 90% of 80 GB)
    assert group == 8 * 4, group
    assert smallest_group(LLAMA_70B, TP8_FSDP64, RUN, 10_000 * GB, 8) == 8, "a node, when it all fits"
    assert smallest_group(LLAMA_70B, TP8_FSDP64, RUN, 1 * GB, 8) == 512, "nothing fits: the whole replica"
    assert smallest_group(LLAMA_70B, TP8_FSDP64, RUN, 80 * GB, 64) >= 64, "never less than a node"


def test_a_moe_checkpoint_holds_every_expert_once_whatever_ep_splits_them():
    moe = ModelShape(
        vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_dim=4096, n_experts=8, top_k=2,
        expert_ffn_dim=1024, n_dense_layers=1,
    )  # fmt: skip
    # attention 8 x 2.6M, embedding and output 2 x 32.8M, the first (dense) block's FFN 12.6M, 7 routers, the
    # experts of 7 MoE blocks 7 x 8 x 3.1M, norms (step_time.expert_params counts 8 MoE blocks: 4.6% more)
    params = (
        8 * 1024 * 64 * 40
        + 2 * 32000 * 1024
        + 3 * 1024 * 4096
        + 7 * 8 * 1024
        + 7 * 8 * 3 * 1024**2
        + 17 * 1024
    )
    whole = 12 * params  # fp32 weights and AdamW's two states
    for ep in (1, 2, 8):
        layout = Layout(dp_shard=8, ep=ep)
        assert checkpoint_bytes(moe, layout, RunShape(1, 1024)) == pytest.approx(whole, rel=0.001), ep
