"""`trainer plan --keep tp=8,pp=16`: pins on the dimensions the search varies (the Layout's fields, and the
micro-batch of each forward-backward pass), validated against the planned world before anything is searched.
A searched field without CHOICES takes an integer >= 1 (every one the search varies today does)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from strategies.plan.search import divisors
from strategies.plan.shapes import ACTIVATION_CHECKPOINTING, PIPELINE_SCHEDULES, Layout, RunShape

MESH = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")  # each a divisor of the world (ep reuses ranks)
# Layout fields the search never varies, so a pin on them could only empty it: the recipe decides precision
# and the fused loss, sequence parallel follows tp, the search does not offload, and the kernels (fused,
# flash attention) are what the runtime has, given to the search whole
NOT_SEARCHED = (
    "sequence_parallel", "precision", "loss_chunk_tokens", "cpu_offload", "fused_kernels", "flash_attention",
)  # fmt: skip
CHOICES: dict[str, tuple[Any, ...]] = {
    "activation_checkpointing": ACTIVATION_CHECKPOINTING,
    "pp_schedule": PIPELINE_SCHEDULES,
    "zero_stage": (1, 2, 3),
}
MICRO_BATCH = "micro_batch"  # sequences of each forward-backward pass of a rank: the table's "mb"


def keys() -> list[str]:
    """The keys --keep takes: the Layout's searched fields, in its order, then the micro-batch."""
    return [f.name for f in dataclasses.fields(Layout) if f.name not in NOT_SEARCHED] + [MICRO_BATCH]


@dataclass(frozen=True)
class Keep:
    """Pinned values by key; called on a (layout, run) of the search, True when it obeys every pin."""

    pins: dict[str, Any]

    def __call__(self, layout: Layout, run: RunShape) -> bool:
        return all(_value(layout, run, key) == value for key, value in self.pins.items())

    def __str__(self) -> str:
        return ",".join(f"{key}={value}" for key, value in self.pins.items())

    def unweighed(self, candidates: Iterable[tuple[Layout, RunShape]]) -> str | None:
        """Why none of `candidates` (what the search lists) obeys every pin, in one line: the first pin none
        of them has, with the values they have, else the pins together; None when one obeys them all, or
        when nothing is listed (then the search's own message says why)."""
        seen: dict[str, set[Any]] = {key: set() for key in self.pins}
        for layout, run in candidates:
            if self(layout, run):
                return None
            for key in self.pins:
                seen[key].add(_value(layout, run, key))
        if not any(seen.values()):
            return None
        for key, value in self.pins.items():
            if value not in seen[key]:
                return (
                    f"--keep {key}={value}: no layout the search weighs for this model, world and batch has it; "
                    f"allowed: {', '.join(map(str, sorted(seen[key])))}"
                )
        return f"--keep {self}: no layout the search weighs for this model, world and batch has them all at once; allowed: fewer pins"


def _value(layout: Layout, run: RunShape, key: str) -> Any:
    if key == MICRO_BATCH:  # a pipeline cuts the rank's batch into pp_microbatches (search.pass_size)
        return run.micro_batch // layout.pp_microbatches
    return getattr(layout, key)


def parse_keep(text: str, world: int) -> Keep:
    """The pins of `text` ("tp=8,pp=16,activation_checkpointing=full") for a world of `world` GPUs; a
    one-line ValueError naming the key and what it allows for an unknown key or a value out of range."""
    allowed = keys()
    pins: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, raw = (part.strip() for part in item.partition("="))
        key = key.replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--keep {text!r}: {item.strip()!r} is not key=value; allowed: e.g. tp=8,pp=16")
        if key not in allowed:
            raise ValueError(f"--keep {key}={raw}: unknown key {key!r}; allowed: {', '.join(allowed)}")
        if key in pins:
            raise ValueError(f"--keep {key}={raw}: {key} is pinned twice; allowed: one value a key")
        pins[key] = _parse(key, raw, world)
    mesh = math.prod(pins.get(dim, 1) for dim in MESH if dim != "ep")
    if world % mesh:
        dims = ",".join(f"{key}={value}" for key, value in pins.items() if key in MESH and key != "ep")
        raise ValueError(
            f"--keep {dims}: their product {mesh} does not divide the {world} GPUs; allowed: degrees whose "
            f"product divides {world}"
        )
    return Keep(pins)


def _parse(key: str, raw: str, world: int) -> Any:
    """`raw` as the value of `key` (one of CHOICES, else an integer >= 1; a mesh degree divides the
    world), or a one-line ValueError naming the key and what it allows."""
    choices = CHOICES.get(key)
    if choices is not None:
        value: Any = int(raw) if isinstance(choices[0], int) and _is_int(raw) else raw
        if value not in choices:
            shown = ", ".join(map(str, choices))
            raise ValueError(f"--keep {key}={raw}: {key} takes one of the searched values; allowed: {shown}")
        return value
    if key in MESH:
        if not _is_int(raw) or int(raw) < 1 or world % int(raw):
            raise ValueError(
                f"--keep {key}={raw}: {key} takes a divisor of the {world} GPUs; allowed: {_divisors_text(world)}"
            )
        return int(raw)
    if not _is_int(raw) or int(raw) < 1:
        raise ValueError(f"--keep {key}={raw}: {key} takes an integer >= 1; allowed: 1, 2, 3, ...")
    return int(raw)


def _is_int(raw: str) -> bool:
    return raw.isascii() and raw.isdigit()


def _divisors_text(world: int) -> str:
    found = divisors(world)
    shown = ", ".join(map(str, found[:12]))
    return shown + (f", ... {found[-1]}" if len(found) > 12 else "")
