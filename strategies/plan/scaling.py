"""How many GPUs a model can absorb: the planner's throughput at each GPU count, weighed by the step/example
trade-off of McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", arXiv:1812.06162, eq. 2.11
and fig. 7): to reach a given loss, a run at batch B needs

    S / S_min = 1 + B_noise / B   optimizer steps,   E / E_min = 1 + B / B_noise   examples,

where B_noise is the gradient noise scale (`callbacks.GradientNoiseScale` measures it). Below B_noise a
larger batch saves steps almost for free; far beyond it each doubling of the batch nearly doubles the
examples (the compute) and saves few steps: more GPUs then buy a cleaner gradient, not a shorter run.

The curve is data-parallel growth at a fixed target loss: at G GPUs the global batch is the planned run's
share per GPU times G, the planner's best layout gives tokens/s, and the time to the target is the examples
needed over the examples per second, both relative to the planned run.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# a planned batch this many times the noise scale draws a warning: at twice it a run takes 1.5x the fewest
# steps and 3x the fewest examples (at B_noise, the critical batch, both are 2x)
WARN_ABOVE = 2.0
METRIC = "noise_scale"  # the column GradientNoiseScale logs
ALLOWED = (
    "allowed: a number > 0 (the noise scale in sequences per step), or a metrics.csv / metrics.jsonl file or a "
    "run folder holding a noise_scale value (logged by callbacks.GradientNoiseScale)"
)


def steps_over_min(batch: float, noise_scale: float) -> float:
    """S / S_min = 1 + B_noise / B: the optimizer steps to a given loss, over those of an infinite batch."""
    return 1.0 + noise_scale / batch


def examples_over_min(batch: float, noise_scale: float) -> float:
    """E / E_min = 1 + B / B_noise: the examples to a given loss, over those of a batch of one."""
    return 1.0 + batch / noise_scale


def batch_warning(global_batch: int, noise_scale: float, source: str) -> str | None:
    """A warning line when `global_batch` is more than WARN_ABOVE times the noise scale, else None."""
    ratio = global_batch / noise_scale
    if ratio <= WARN_ABOVE:
        return None
    steps, examples = steps_over_min(global_batch, noise_scale), examples_over_min(global_batch, noise_scale)
    # against a batch of B_noise, where both factors are 2
    return (
        f"warning: the global batch of {global_batch:,} sequences is {ratio:.1f}x the noise scale "
        f"B_noise = {noise_scale:,.0f} ({source}); past it more batch saves few steps (McCandlish et al. 2018: "
        f"S/S_min = 1 + B_noise/B = {steps:.2f}, E/E_min = 1 + B/B_noise = {examples:.2f}): a batch of "
        f"{noise_scale:,.0f} reaches the same loss with {examples / 2:.1f}x fewer examples (compute) in "
        f"{2 / steps:.2f}x the steps"
    )


@dataclass(frozen=True)
class ScalingPoint:
    """The planner's answer at one GPU count: the global batch there and the best layout's tokens/s
    (None, with the planner's reason, when no layout fits)."""

    gpus: int
    global_batch: int
    tokens_per_s: float | None
    why_none: str | None = None


def gpu_counts(planned: int, below: int = 8, above: int = 8) -> list[int]:
    """Powers of two from about planned/`below` (at least 1) to planned x `above`, with `planned` itself."""
    low = 1 << max(0, (planned // below).bit_length() - 1)
    counts = {planned}
    g = low
    while g <= planned * above:
        counts.add(g)
        g *= 2
    return sorted(counts)


def scaled_batch(planned_batch: int, planned_gpus: int, gpus: int) -> int:
    """The global batch at `gpus` GPUs: the planned run's share per GPU times `gpus` (at least 1)."""
    return max(1, round(planned_batch * gpus / planned_gpus))


def strong_scaling(
    tokens_per_s: Callable[[int, int], float], planned_gpus: int, planned_batch: int, counts: list[int]
) -> list[ScalingPoint]:
    """`tokens_per_s(gpus, global_batch)` (the planner's best layout; a ValueError when none fits) at each
    of `counts`, each with its scaled batch."""
    points = []
    for gpus in counts:
        batch = scaled_batch(planned_batch, planned_gpus, gpus)
        try:
            points.append(ScalingPoint(gpus, batch, tokens_per_s(gpus, batch)))
        except ValueError as err:
            points.append(ScalingPoint(gpus, batch, None, str(err)))
    return points


def relative_time(point: ScalingPoint, planned: ScalingPoint, noise_scale: float) -> float | None:
    """Time to the target loss at `point` over the planned run's: the examples needed (E/E_min) over the
    examples per second (tokens/s at a fixed sequence length); None where no layout fits."""
    if point.tokens_per_s is None or planned.tokens_per_s is None:
        return None
    examples = examples_over_min(point.global_batch, noise_scale) / examples_over_min(
        planned.global_batch, noise_scale
    )
    return examples * planned.tokens_per_s / point.tokens_per_s


def scaling_lines(
    points: list[ScalingPoint], planned_gpus: int, noise_scale: float, source: str = "given"
) -> list[str]:
    """The curve as a table (steps, examples, time and GPU-hours to the target loss relative to the planned
    run, marked *) and a line naming the GPU count where the batch reaches the noise scale."""
    planned = next(p for p in points if p.gpus == planned_gpus)
    lines = [
        f"strong scaling at B_noise = {noise_scale:,.0f} ({source}; the batch grows with the GPUs; to the same loss "
        "S/S_min = 1 + B_noise/B, E/E_min = 1 + B/B_noise), relative to the planned run (*):",
        f"  {'GPUs':>7} {'batch':>8} {'tokens/s':>14} {'steps':>7} {'examples':>9} {'time':>7} {'GPU-h':>7}",
    ]
    for p in points:
        steps = steps_over_min(p.global_batch, noise_scale) / steps_over_min(
            planned.global_batch, noise_scale
        )
        examples = examples_over_min(p.global_batch, noise_scale) / examples_over_min(
            planned.global_batch, noise_scale
        )
        time = relative_time(p, planned, noise_scale)
        mark = "*" if p is planned else " "
        rate = "no layout fits" if p.tokens_per_s is None else f"{p.tokens_per_s:,.0f}"
        shown = "-" if time is None else f"{time:.2f}"
        cost = "-" if time is None else f"{time * p.gpus / planned_gpus:.2f}"
        lines.append(
            f"  {p.gpus:>6}{mark} {p.global_batch:>8,} {rate:>14} {steps:>7.2f} {examples:>9.2f} {shown:>7} {cost:>7}"
        )
    # doubling a batch of B_noise takes S/S_min from 2 to 1.5: a quarter of the time at best, twice the GPUs
    knee = planned_gpus * noise_scale / planned.global_batch
    lines.append(
        f"the batch reaches B_noise at ~{knee:,.0f} GPUs: past it each doubling of the GPUs saves under a quarter "
        "of the time (S/S_min 2 -> 1.5 at best) for nearly twice the GPU-hours"
    )
    return lines


def read_noise_scale(value: str) -> tuple[float, str]:
    """The noise scale `--noise-scale` names, and where it came from: a number, or the last `noise_scale`
    of a metrics file (CSV or JSONL) or of the newest such file in a run folder. A one-line ValueError else."""
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is not None:
        if not (math.isfinite(number) and number > 0):
            raise ValueError(f"--noise-scale {value}: {ALLOWED}")
        return number, "given"
    path = Path(value)
    if path.is_dir():
        files = [f for pattern in ("metrics.jsonl", "metrics.csv") for f in path.rglob(pattern)]
        found = [
            (f, v) for f in sorted(files, key=lambda f: f.stat().st_mtime, reverse=True) if (v := _last(f))
        ]
        if not found:
            raise ValueError(
                f"--noise-scale {value}: no metrics file under it holds a noise_scale value; {ALLOWED}"
            )
        path, number = found[0][0], found[0][1]
    elif path.is_file():
        number = _last(path)
        if number is None:
            raise ValueError(f"--noise-scale {value}: the file holds no noise_scale value; {ALLOWED}")
    else:
        raise ValueError(f"--noise-scale {value}: neither a number nor an existing file or folder; {ALLOWED}")
    return number, f"the last noise_scale in {path}"


def _last(path: Path) -> float | None:
    """The last finite, positive `noise_scale` of a metrics file (JSONL rows, or CSV columns ending in it)."""
    rows: list[dict[str, Any]]
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    if path.suffix == ".jsonl":
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    else:
        rows = list(csv.DictReader(text.splitlines()))
    for row in reversed(rows):
        if not isinstance(row, dict):
            continue
        for key, cell in row.items():
            # CSVLogger's prefix joins with "-"
            if key == METRIC or (isinstance(key, str) and key.endswith(f"-{METRIC}")):
                try:
                    number = float(cell)
                except (TypeError, ValueError):
                    continue
                if math.isfinite(number) and number > 0:
                    return number
    return None


def noise_scale_report(
    inputs: Any, hardware: Any, planned_gpus: int, noise_scale: float, source: str
) -> list[str]:
    """What `trainer plan --noise-scale` prints: the warning when the planned global batch is far beyond the
    noise scale, then the strong-scaling curve from the planner's best layout at each GPU count.
    `inputs` is the recipe as the planner reads it (shape, seq_len, global_batch, precision, optimizer)."""
    from strategies.plan.search import search

    def tokens_per_s(gpus: int, global_batch: int) -> float:
        plan = search(
            inputs.shape, hardware, gpus, inputs.seq_len, global_batch, inputs.precision, inputs.optimizer
        )
        return plan.best.time.tokens_per_s

    counts = gpu_counts(planned_gpus)
    points = strong_scaling(tokens_per_s, planned_gpus, inputs.global_batch, counts)
    warning = batch_warning(inputs.global_batch, noise_scale, source)
    return ([warning] if warning else []) + scaling_lines(points, planned_gpus, noise_scale, source)
