"""One given layout (a recipe's own) against a search's ranked layouts: its place in the table, its speed
and MFU against the best, its peak memory per rank and whether it fits, and what its step is spent on."""

from __future__ import annotations

from dataclasses import dataclass

from strategies.plan.hardware import Hardware
from strategies.plan.search import USABLE_MEMORY, Candidate, Plan, default_memory
from strategies.plan.shapes import Layout, ModelShape, RunShape
from strategies.plan.step_time import StepTime, step_time


@dataclass(frozen=True)
class Score:
    """A layout's predicted step and peak, placed among a plan's ranked layouts."""

    layout: Layout
    run: RunShape
    peak_bytes: float
    usable_bytes: float  # what a rank may fill of the device (search.USABLE_MEMORY of it)
    time: StepTime
    rank: int  # 1 + the plan's ranked layouts strictly faster than it
    ranked: int  # how many layouts the plan ranked
    best: Candidate

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes


def largest_costs(time: StepTime, n: int = 3) -> list[tuple[str, float]]:
    """The `n` largest parts of the step (compute, each technique's exposed communication, the pipeline
    bubble, host waits: they add up to the step), largest first, as (name, seconds)."""
    costs = {"compute": time.compute_s, **time.exposed_s}
    shown = sorted(((s, name) for name, s in costs.items() if s > 0), reverse=True)
    return [(name, s) for s, name in shown[:n]]


def score(shape: ModelShape, layout: Layout, run: RunShape, hardware: Hardware, plan: Plan) -> Score:
    """`layout` running `run` on `hardware`, weighed by the search's memory and step-time models and placed
    among `plan`'s ranked layouts."""
    peak = float(default_memory()(shape, layout, run).peak)
    time = step_time(shape, layout, run, hardware)
    faster = sum(c.time.tokens_per_s > time.tokens_per_s for c in plan.ranked)
    usable = hardware.device.memory_bytes * USABLE_MEMORY
    return Score(layout, run, peak, usable, time, faster + 1, len(plan.ranked), plan.best)
