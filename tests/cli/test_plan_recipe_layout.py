"""`trainer plan` scores the recipe's own layout (its place among the searched layouts, tokens/s and MFU
against the best, peak memory, its three largest costs) with the planner's own models, or names the one
constraint that keeps it from running; `--keep tp=8,pp=4` pins the search, and a bad pin is one line."""

from __future__ import annotations

import re

import pytest
from helpers import REPO, SMALL, TINY

from strategies.plan.from_strategy import layout_of
from strategies.plan.hardware import GB, build_hardware
from strategies.plan.keep import parse_keep
from strategies.plan.memory import per_rank_memory
from strategies.plan.search import USABLE_MEMORY, layout_text, layouts, search
from strategies.plan.shapes import RunShape
from strategies.plan.step_time import step_time
from strategies.registry import build_strategy
from trainer.cli import main
from trainer.config import load_recipe
from trainer.config.plan_inputs import plan_inputs

LLAMA_70B = REPO / "recipes" / "llama_70b.yaml"
# a table row: rank, layout, mb, GB/GPU, tokens/s, MFU, dominant cost
ROW = re.compile(r"^\s+(\d+)\s{2}(.+?)\s+(\d+)\s+([\d.]+)\s+([\d,]+)\s+([\d.]+)%\s{2}(.+)$")
H100 = build_hardware("h100", 8, "ib-ndr")


def plan(capsys, recipe, *args) -> str:
    assert main(["plan", str(recipe), *args]) == 0
    return capsys.readouterr().out


def rows(out: str) -> list[tuple[str, int, float]]:
    """(layout, micro-batch, tokens/s) of each table row."""
    found = [ROW.match(line) for line in out.splitlines()]
    return [(m[2], int(m[3]), float(m[5].replace(",", ""))) for m in found if m]


def test_the_recipes_own_layout_is_scored_by_the_planners_models(capsys):
    out = plan(capsys, LLAMA_70B, "--gpus", "128", "--top", "100000")  # every mesh in the table
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("recipe's layout"))
    head, ranked, peak_line, cost_line = lines[at : at + 4]
    # the recipe's strategy section, built as the Trainer builds it over 128 processes: tp=8 x pp=4
    # (Interleaved1F1B, 16 micro-batches) x FSDP over the remaining 4; 256 sequences a step are 64 per
    # data-parallel rank, 4 accumulated batches of 16, each cut into 16 pipeline micro-batches of 1
    strategy = build_strategy(
        "parallel3d", processes=128, tp=8, pp=4, dp_shard=-1, pp_schedule="Interleaved1F1B", microbatches=16,
        zero_stage=3, activation_checkpointing="full",
    )  # fmt: skip
    layout = layout_of(strategy, 128, "bf16-mixed", None, 2048)
    run = RunShape(16, 8192, accumulation=4)
    shape = plan_inputs(load_recipe(LLAMA_70B)).shape
    time, peak = step_time(shape, layout, run, H100), per_rank_memory(shape, layout, run).peak
    assert (layout.tp, layout.pp, layout.dp_shard, layout.activation_checkpointing) == (8, 4, 4, "full")
    assert head == f"recipe's layout: {layout_text(layout)} (micro-batch 1)", head
    table = rows(out)
    faster = sum(tokens > time.tokens_per_s for _, _, tokens in table)
    best = table[0][2]
    assert ranked.startswith(
        f"  rank {faster + 1} ({faster} of the {len(table)} searched meshes faster): "
    ), ranked
    assert f": {time.tokens_per_s:,.0f} tokens/s, MFU {time.mfu:.1%} (" in ranked, ranked
    assert f"{time.tokens_per_s / best - 1:+.0%} against the best: {best:,.0f} tokens/s" in ranked, ranked
    assert (
        peak_line
        == f"  peak {peak / GB:.1f} GB per GPU: fits ({80 * USABLE_MEMORY:.1f} GB usable of 80.0 GB)"
    )
    # its three largest costs, largest first: the step's parts (compute and each exposed wait) add up to it
    parts = {"compute": time.compute_s, **time.exposed_s}
    assert sum(parts.values()) == pytest.approx(time.step_s)
    largest = sorted(parts, key=parts.get, reverse=True)[:3]
    printed = cost_line.split("largest costs: ")[1].split(", ")
    assert [p.split(" (")[0].rsplit(" ", 1)[0] for p in printed] == largest, cost_line
    assert cost_line.startswith(f"  step {time.step_s:.3g}s, "), cost_line


def test_keep_pins_every_layout_the_search_weighs(capsys):
    out = plan(capsys, LLAMA_70B, "--gpus", "128", "--keep", "tp=8,pp=4,micro_batch=1", "--top", "100000")
    assert "layouts tried (--keep tp=8,pp=4,micro_batch=1)" in out
    table = rows(out)
    assert len(table) > 3, out
    for layout, micro_batch, _ in table:
        assert layout.startswith("tp=8 sp x ") and re.search(r"\bpp=4 ", layout) and micro_batch == 1, layout
    # the recipe's own layout obeys the pins too: scored without a note
    assert "recipe's layout: tp=8 sp x pp=4 " in out and "outside --keep" not in out


def test_keep_narrows_the_search_to_exactly_the_layouts_that_obey_it():
    inputs = plan_inputs(load_recipe(TINY, [*SMALL, "data.global_batch_size=32"]))
    args = (inputs.shape, H100, 8, inputs.seq_len, inputs.global_batch)
    keep = parse_keep("cp=2,activation_checkpointing=selective,micro_batch=2", 8)
    pinned = search(*args, keep=keep)
    every = list(layouts(inputs.shape, 8, 8, inputs.seq_len, inputs.global_batch))
    assert pinned.tried == sum(keep(layout, run) for layout, run in every) < len(every)
    for c in pinned.ranked:
        assert (c.layout.cp, c.layout.activation_checkpointing, c.run.micro_batch // c.layout.pp_microbatches) == (
            2, "selective", 2,
        )  # fmt: skip
    assert search(*args).tried == len(every), "no pins: every layout listed is weighed"


@pytest.mark.parametrize(
    ("keep", "message"),
    [
        (
            "tq=2",
            "--keep tq=2: unknown key 'tq'; allowed: dp_replicate, dp_shard, tp, pp, cp, ep, zero_stage,",
        ),
        ("tp=two", "--keep tp=two: tp takes a divisor of the 8 GPUs; allowed: 1, 2, 4, 8"),
        ("tp=3", "--keep tp=3: tp takes a divisor of the 8 GPUs; allowed: 1, 2, 4, 8"),
        ("pp=0", "--keep pp=0: pp takes a divisor of the 8 GPUs; allowed: 1, 2, 4, 8"),
        (
            "zero_stage=4",
            "--keep zero_stage=4: zero_stage takes one of the searched values; allowed: 1, 2, 3",
        ),
        ("activation_checkpointing=some", "allowed: none, selective, full"),
        (
            "micro_batch=1.5",
            "--keep micro_batch=1.5: micro_batch takes an integer >= 1; allowed: 1, 2, 3, ...",
        ),
        (
            "tp=4,pp=4",
            "--keep tp=4,pp=4: their product 16 does not divide the 8 GPUs; allowed: degrees whose",
        ),
        ("tp=2,tp=4", "--keep tp=4: tp is pinned twice; allowed: one value a key"),
        ("tp", "--keep 'tp': 'tp' is not key=value; allowed: e.g. tp=8,pp=16"),
        ("precision=fp32", "--keep precision=fp32: unknown key 'precision'; allowed: dp_replicate,"),
        (
            "fused_kernels=true",
            "--keep fused_kernels=true: unknown key 'fused_kernels'; allowed: dp_replicate,",
        ),
        # valid values the search never weighs for this model: named with those it does
        (
            "ep=2",
            "--keep ep=2: no layout the search weighs for this model, world and batch has it; allowed: 1",
        ),
        (
            "tp=8",
            "--keep tp=8: no layout the search weighs for this model, world and batch has it; allowed: 1, 2",
        ),
        (  # each value is weighed, never the three together
            "zero_stage=2,cp=4,pp=2",
            "--keep zero_stage=2,cp=4,pp=2: no layout the search weighs for this model, world and batch has them all "
            "at once; allowed: fewer pins",
        ),
    ],
)
def test_a_bad_keep_is_one_line_naming_the_key_and_what_it_allows(capsys, keep, message):
    vocab = "model.vocab_size=256"  # tp divides it (the byte tokenizer's 257 takes no tp)
    assert main(["plan", str(TINY), *SMALL, vocab, "--gpus", "8", "--keep", keep]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainer: error: "), err
    assert message in err, err


def test_pins_whose_layouts_are_all_over_the_memory_get_the_searchs_reason(capsys):
    keep = "tp=1,pp=1,cp=1,activation_checkpointing=none"  # 70B at 8K, no recompute, FSDP alone
    assert main(["plan", str(LLAMA_70B), "--gpus", "128", "--keep", keep]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(
        f"trainer: error: plan --keep {keep}: no layout of 128 GPUs fits in 80 GB per GPU"
    ), err


@pytest.mark.parametrize(
    ("overrides", "gpus", "line"),
    [
        (["strategy={name: parallel3d, tp: 4}"], "2", "recipe's layout on 2 GPUs: parallel dims dp_shard=-1 x tp=4: "
         "the others make 4 ranks, which does not divide the world of 2 processes"),
        (["strategy={name: parallel3d, tp: 4}"], "8", "recipe's layout on 8 GPUs: tp=4 does not divide the model's 2 "
         "kv-heads"),
        (["strategy={name: fsdp}", "data.global_batch_size=12"], "8", "recipe's layout on 8 GPUs: the global batch "
         "of 12 sequences does not split over 8 data-parallel ranks x accumulate_grad_batches=1"),
        (["strategy={name: single}"], "8", "recipe's layout on 8 GPUs: strategy 'single' runs one process, not 8"),
        ([], "8", "recipe's layout: strategy auto, which runs the best above (#1) at start-up"),
    ],
)  # fmt: skip
def test_a_recipe_layout_that_cannot_run_there_says_why_and_the_best_is_still_shown(
    capsys, overrides, gpus, line
):
    out = plan(capsys, TINY, *SMALL, *overrides, "--gpus", gpus)
    assert line in out and out.count("recipe's layout") == 1, out
    assert "\n   1  " in out and "\noverrides: " in out, "the best layout and its overrides"


def test_a_recipe_layout_over_the_memory_says_how_far(capsys):
    out = plan(
        capsys, LLAMA_70B, "--gpus", "128", "strategy.activation_checkpointing=null", "data.seq_len=16384"
    )
    line = next(line for line in out.splitlines() if line.startswith("recipe's layout"))
    strategy = build_strategy(
        "parallel3d", processes=128, tp=8, pp=4, dp_shard=-1, pp_schedule="Interleaved1F1B", microbatches=16
    )
    layout = layout_of(strategy, 128, "bf16-mixed", None, 2048)
    peak = per_rank_memory(
        plan_inputs(load_recipe(LLAMA_70B)).shape, layout, RunShape(16, 16384, accumulation=4)
    )
    assert peak.peak > 80 * GB * USABLE_MEMORY, "70B at 16K without recompute: the activations do not fit"
    assert line.startswith(f"recipe's layout: {layout_text(layout)} (micro-batch 1) does not fit: peak ")
    assert (
        f"peak {peak.peak / GB:.1f} GB per GPU, over the {80 * USABLE_MEMORY:.1f} GB usable of 80.0 GB"
        in line
    )
    assert "\n   1  " in out, "the best that fits is still shown"
