"""SavedCheckpoint, what a run knows of each of its checkpoints, and the one rule for which is best."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MODES = ("min", "max")


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint of this run, as ModelCheckpoint and the CheckpointManager list it.

    `good`: validated, or never awaiting validation; one that is not good awaits its reload check (one
    that fails it leaves the list). Until that check, `reference` (the live model's loss at save time,
    None without one), `reference_s` (what taking it cost, part of validation's cost) and `not_finite`
    (why the live model was not finite, None when it was) are what the check needs; a checkpoint listed
    from its folder has none of them, so its checksums and a reload are checked."""

    path: Path
    step: int
    # the monitored value, as meta.json records it; None: saved without one
    score: float | None = None
    good: bool = True
    # seconds since the previous save, and to write this one: what each save reports it cost
    interval_s: float | None = None
    write_s: float = 0.0
    reference: float | None = None
    reference_s: float = 0.0
    not_finite: str | None = None


def ranked(entries: Iterable[SavedCheckpoint], mode: str) -> list[SavedCheckpoint]:
    """`entries` best first by score (`mode` "min"/"max"), those without a score or with NaN last; of
    equal scores the older (the lower step) first, as Lightning keeps the first of equal ones."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid; allowed: 'min' or 'max'")
    sign = 1.0 if mode == "min" else -1.0

    def key(entry: SavedCheckpoint) -> tuple[bool, float, int]:
        unranked = entry.score is None or math.isnan(entry.score)
        return unranked, 0.0 if unranked else sign * entry.score, entry.step

    return sorted(entries, key=key)


def best_first(entries: Iterable[SavedCheckpoint], mode: str) -> list[SavedCheckpoint]:
    """The good checkpoints that have a score, best first (`ranked`): Lightning's `best_k_models` order."""
    return ranked([c for c in entries if c.good and c.score is not None], mode)


def best(entries: Iterable[SavedCheckpoint], mode: str) -> SavedCheckpoint | None:
    """The best good checkpoint by score (of equal ones the older), or None: what `best_model_path`,
    `ckpt_path="best"` and HFModule's `load_best_model_at_end` name."""
    return next(iter(best_first(entries, mode)), None)
