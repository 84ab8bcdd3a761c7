"""The planner against published runs (bench/published_runs.py): per point, the published MFU, the
planner's MFU for the published layout (its mesh, and what else the source publishes: micro-batch size,
activation checkpointing, data parallel sharded or not; what it does not publish the planner picks, the
fastest of those), whether that layout fits the memory model, the planner's own best layout, its MFU and the
published layout's place against it; then the error summary, apart for the points tuned on and the points
held out (every third, bench/published_runs.py's `held_out`).

    python bench/plan_vs_published.py [--only SUBSTRING] [--no-best]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import strategies.plan.search as search_module  # noqa: E402
from bench.published_runs import POINTS, Published, held_out  # noqa: E402
from strategies.plan.hardware import build_hardware  # noqa: E402
from strategies.plan.memory import per_rank_memory  # noqa: E402
from strategies.plan.search import USABLE_MEMORY, layout_text, layouts, search  # noqa: E402
from strategies.plan.shapes import WHAT_IF_CHECKPOINTING, Layout, RunShape  # noqa: E402
from strategies.plan.step_time import StepTime, flops_per_token, step_time  # noqa: E402

GPUS_PER_NODE = 8  # every published run: 8-GPU nodes (DGX A100, Grand Teton)
# interleaved stages per rank weighed (Llama 3's ~8 blocks a stage; the runtime builds 2: a what-if here)
WHAT_IF_STAGES = (2, 3, 4, 6, 8)
# the what-if stages multiply the layouts of a world: the largest published worlds weigh ~70,000 (minutes)
search_module.MAX_LAYOUTS = 200_000


def published_mfu(p: Published) -> float:
    """The run's MFU in the planner's definition (see bench/published_runs.py)."""
    hw = build_hardware(p.device, GPUS_PER_NODE, p.link)
    peak = hw.device.bf16_tflops * 1e12
    fpt = flops_per_token(p.shape, p.seq_len)
    if p.tokens_per_gpu_s is not None:
        return p.tokens_per_gpu_s * fpt / peak
    assert p.tflops is not None
    if "Narayanan" in p.source:  # their TFLOP/s count the recomputed forward: 96 (1 + s/6h + V/16lh)
        s, h, layers, v = p.seq_len, p.shape.dim, p.shape.n_layers, p.shape.vocab_size
        with_recompute = 96 * (1 + s / (6 * h) + v / (16 * layers * h))
        model = 72 * (1 + s / (6 * h) + v / (12 * layers * h))
        return p.tflops * 1e12 * model / with_recompute / peak
    return p.tflops * 1e12 / peak


def runtime_checkpointing(p: Published) -> str | None:
    """The runtime's checkpointing mode the search enumerates for the published one: a what-if policy
    (TorchTitan's "selective_op") is enumerated as "selective", then weighed as itself."""
    ac = p.activation_checkpointing
    return "selective" if ac in WHAT_IF_CHECKPOINTING else ac


def is_published(p: Published, layout: Layout, run: RunShape) -> bool:
    """Whether `layout` is the published one in everything the source publishes (its checkpointing as the
    search enumerates it: `runtime_checkpointing`)."""
    L = layout
    if (
        (L.tp, L.pp, L.cp) != (p.tp, p.pp, p.cp)
        or (L.dp_shard > 1) != p.fsdp
        or L.dp_replicate > 1
        and p.fsdp
    ):
        return False
    if p.zero_stage is not None and L.zero_stage != p.zero_stage:
        return False
    ac = runtime_checkpointing(p)
    if ac is not None and L.activation_checkpointing != ac:
        return False
    passes = run.micro_batch // L.pp_microbatches
    return p.micro_batch is None or passes == p.micro_batch


@dataclass(frozen=True)
class Row:
    point: Published
    held: bool
    published: float
    layout: Layout | None  # the planner's pick among the published layouts (None: it enumerates none)
    time: StepTime | None
    fits: bool
    peak_gb: float
    best_layout: Layout | None
    best: StepTime | None
    rank: int | None  # the published layout's place in the planner's ranking (1: its best)
    same_ac: StepTime | None  # the planner's best with the published activation checkpointing, when published

    @property
    def error(self) -> float | None:
        return None if self.time is None else self.time.mfu / self.published - 1


def evaluate(p: Published, index: int, with_best: bool) -> Row:
    """The planner on point `p`."""
    hw = build_hardware(p.device, GPUS_PER_NODE, p.link)
    limit = hw.device.memory_bytes * USABLE_MEMORY
    kernels = [p.fused] if p.fused is not None else [False, True]
    ac = {"activation_checkpointing": p.activation_checkpointing} if p.activation_checkpointing else {}
    mine = [
        (replace(layout, fused_kernels=fused, flash_attention=p.flash, fsdp_unit=p.fsdp_unit, **ac), run)
        for layout, run in layouts(
            p.shape, p.gpus, GPUS_PER_NODE, p.seq_len, p.global_batch, virtual_stages=WHAT_IF_STAGES
        )
        if is_published(p, layout, run)
        for fused in kernels
    ]
    timed = [(step_time(p.shape, L, run, hw), L, run) for L, run in mine]
    peaks = {id(L): per_rank_memory(p.shape, L, run).peak for _, L, run in timed}
    fitting = [t for t in timed if peaks[id(t[1])] <= limit]
    pick = max(fitting or timed, key=lambda t: t[0].tokens_per_s, default=None)
    best_layout = best = rank = same_ac = None
    if with_best:
        try:
            kernels = {
                "fused_kernels": pick is not None and pick[1].fused_kernels,
                "flash_attention": p.flash,
            }
            plan = search(
                p.shape, hw, p.gpus, p.seq_len, p.global_batch, virtual_stages=WHAT_IF_STAGES, kernels=kernels
            )
        except ValueError as err:
            print(f"  {p.name}: the planner finds no layout: {err}")
        else:
            best_layout, best = plan.best.layout, plan.best.time
            if pick is not None:
                rank = 1 + sum(c.time.tokens_per_s > pick[0].tokens_per_s for c in plan.ranked)
            ac = runtime_checkpointing(p)
            if ac is not None and plan.best.layout.activation_checkpointing != ac:
                pinned = search(
                    p.shape, hw, p.gpus, p.seq_len, p.global_batch, virtual_stages=WHAT_IF_STAGES,
                    kernels=kernels, keep=lambda L, run: L.activation_checkpointing == ac,
                )  # fmt: skip
                same_ac = pinned.best.time
            else:
                same_ac = best
    return Row(
        p, held_out(index), published_mfu(p),
        None if pick is None else pick[1], None if pick is None else pick[0],
        bool(fitting), (peaks[id(pick[1])] if pick else 0.0) / 1e9, best_layout, best, rank, same_ac,
    )  # fmt: skip


def summary(rows: list[Row], label: str) -> str:
    """Median and worst |error| of the published layouts' MFU, and how many rank within 5% of the best."""
    errors = [abs(r.error) for r in rows if r.error is not None]
    near = [r for r in rows if r.best is not None and r.time is not None]
    close = sum(r.time.tokens_per_s >= 0.95 * r.best.tokens_per_s for r in near)
    same = [r for r in near if r.same_ac is not None]
    close_ac = sum(r.time.tokens_per_s >= 0.95 * r.same_ac.tokens_per_s for r in same)
    fits = sum(r.fits for r in rows)
    if not errors:
        return f"{label}: no point predicted"
    return (
        f"{label} ({len(rows)} points, {len(errors)} predicted): MFU error median {statistics.median(errors):.1%}, "
        f"worst {max(errors):.1%}; published layout fits memory {fits}/{len(rows)}; within 5% of the planner's "
        f"best {close}/{len(near)}, of its best with the published checkpointing {close_ac}/{len(same)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="points whose name contains this")
    parser.add_argument("--no-best", action="store_true", help="skip the planner's own search (faster)")
    args = parser.parse_args()
    rows = []
    for i, p in enumerate(POINTS):
        if args.only not in p.name:
            continue
        start = time.perf_counter()
        r = evaluate(p, i, not args.no_best)
        rows.append(r)
        tag = "held out" if r.held else "tuning"
        print(f"{p.name} [{tag}; {p.source}]")
        if r.time is None:
            print(f"  published MFU {r.published:.1%}; the planner enumerates no such layout")
            continue
        fit = "fits" if r.fits else "OUT OF MEMORY"
        measured = "" if p.memory_gib is None else f"; published {p.memory_gib * 2**30 / 1e9:.0f} GB reserved"
        print(
            f"  published MFU {r.published:.1%}  planner {r.time.mfu:.1%} ({r.error:+.0%})  {fit} "
            f"({r.peak_gb:.0f} GB{measured})  as {layout_text(r.layout)}"
        )
        print(f"    {r.time.line()}")
        if r.best is not None:
            ratio = r.time.tokens_per_s / r.best.tokens_per_s
            print(
                f"  planner's best {r.best.mfu:.1%} as {layout_text(r.best_layout)}; published layout rank "
                f"{r.rank}, {ratio:.0%} of the best"
                + (
                    f", {r.time.tokens_per_s / r.same_ac.tokens_per_s:.0%} of the best with its checkpointing"
                    if r.same_ac
                    else ""
                )
            )
            if ratio < 0.95 and p.why_not_best:
                print(f"  not within 5% of the best: {p.why_not_best}")
        print(f"  ({time.perf_counter() - start:.1f}s)")
    print()
    print(summary([r for r in rows if not r.held], "tuning"))
    print(summary([r for r in rows if r.held], "held out"))


if __name__ == "__main__":
    main()
