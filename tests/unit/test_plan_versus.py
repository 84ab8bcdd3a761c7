"""`trainer plan`'s line weighing the other answer to "pipeline stages across nodes?": which layout it names,
the speed it gives against the winner's, when it calls the two a tie, and on one node no line at all."""

from strategies.plan.hardware import build_hardware
from strategies.plan.search import Candidate, versus
from strategies.plan.shapes import Layout, RunShape
from strategies.plan.step_time import StepTime

HW = build_hardware("h100", 8, "ib-ndr")  # 8 GPUs a node
RUN = RunShape(1, 8192)


def candidate(tokens_per_s: float, exposed: dict[str, float], **layout) -> Candidate:
    time = StepTime(compute_s=1.0, exposed_s=exposed, step_s=1.0, tokens_per_s=tokens_per_s)
    return Candidate(Layout(**layout), RUN, 40e9, time)


FSDP_2D = dict(tp=8, dp_shard=8)  # 64 GPUs: tp in the node, FSDP across the 8 nodes
PP_ACROSS = dict(tp=8, pp=4, dp_shard=2, pp_microbatches=8)  # pp is the outermost dimension: across nodes


def test_a_winner_without_pipelining_is_weighed_against_the_fastest_layout_that_pipelines_across_nodes():
    winner = candidate(1000, {"tp": 0.2, "fsdp": 0.01}, **FSDP_2D)
    flat = candidate(990, {"fsdp": 0.02}, tp=4, dp_shard=16)  # no pipeline either: not the other answer
    slower = candidate(900, {"pp bubble": 0.3, "pp p2p": 0.02}, **PP_ACROSS)
    line = versus([winner, flat, slower], HW, 64)
    assert line == (
        "pipeline stages across nodes: tp=8 x pp=4 1f1b/8 x fsdp z3=2 predicts 900 tokens/s (-10%); "
        "its step waits pp bubble 0.3s + pp p2p 0.02s, the winner's tp 0.2s + fsdp 0.01s"
    )


def test_a_pipelined_winner_is_weighed_against_the_fastest_layout_without_and_a_near_miss_is_a_tie():
    fastest = candidate(1000, {"pp bubble": 0.1}, **PP_ACROSS)
    winner = candidate(990, {"pp bubble": 0.1}, **{**PP_ACROSS, "pp": 2, "dp_shard": 4})  # simpler in a tie
    flat = candidate(985, {}, **FSDP_2D)  # within 2% of the fastest: it lost the tie-break
    assert versus([winner, fastest, flat], HW, 64) == (
        "no pipeline across nodes: tp=8 x fsdp z3=8 predicts 985 tokens/s (-1%: within 2% of the fastest, "
        "a tie, which fewer dimensions, passes and memory win); its step waits on nothing, the winner's "
        "pp bubble 0.1s"
    )
    # within 2% of the winner but 2.5% below the fastest: slower, no tie (the tie band is the fastest's)
    far = candidate(975, {}, **FSDP_2D)
    assert "(-2%); its step" in versus([winner, fastest, far], HW, 64)


def test_one_node_or_no_layout_of_the_other_kind_gives_no_line():
    winner = candidate(1000, {}, tp=8)
    assert versus([winner, candidate(900, {}, tp=4, pp=2, pp_microbatches=4)], HW, 8) is None
    assert versus([candidate(1000, {}, **FSDP_2D), candidate(990, {}, tp=4, dp_shard=16)], HW, 64) is None
