"""Strategy names used in recipes and `Trainer(strategy="...")`, mapped to their classes; and the one
translation of a planned layout (strategies/plan) into a name and arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from strategies.base import Strategy
from strategies.ddp import DDPStrategy
from strategies.dp_sgd import DPSGDStrategy
from strategies.fsdp import FSDPStrategy
from strategies.parallel3d import Parallel3DStrategy
from strategies.single import SingleDeviceStrategy

if TYPE_CHECKING:
    from strategies.plan.shapes import Layout

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "parallel3d": Parallel3DStrategy,
    "dp_sgd": DPSGDStrategy,
}
NAMES = ("auto", *STRATEGIES)
# Lightning's DDP names: the start method is this project's own (a script re-executes itself, see
# trainer/core/launch.py), so "ddp_spawn"/"ddp_fork"/"ddp_notebook" are "ddp"; "_find_unused_parameters_true"
# sets DDP's flag, as Lightning's registry does
ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    f"{name}{suffix}": ("ddp", {} if not suffix else {"find_unused_parameters": suffix.endswith("true")})
    for name in ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook")
    for suffix in ("", "_find_unused_parameters_false", "_find_unused_parameters_true")
    if name != "ddp" or suffix
}
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}  # plan -> pipeline


def build_strategy(spec: str | Strategy, processes: int = 1, **kwargs: Any) -> Strategy:
    """A Strategy from a registered name (with constructor kwargs) or an instance given as is.
    "auto" is "single" for one process and "ddp" for more."""
    if isinstance(spec, Strategy):
        return spec
    if spec == "auto":
        spec = "single" if processes == 1 else "ddp"
    if isinstance(spec, str) and spec in ALIASES:
        spec, implied = ALIASES[spec]
        kwargs = {**implied, **kwargs}
    if not isinstance(spec, str) or spec not in STRATEGIES:
        raise ValueError(
            f"strategy={spec!r} is unknown; allowed: {', '.join(NAMES)}, Lightning's ddp_* names or a Strategy instance"
        )
    return STRATEGIES[spec](**kwargs)


def layout_spec(layout: Layout) -> dict[str, Any]:
    """The strategy that runs a planned layout, as a recipe's strategy section (name + arguments): one
    process "single", replicas only "ddp", a data-parallel-only sharded layout "fsdp", else "parallel3d".
    Activation checkpointing is the Trainer flag's for single/ddp (their strategies take no such argument)."""
    ac = None if layout.activation_checkpointing == "none" else layout.activation_checkpointing
    L = layout
    if L.world == 1:
        return {"name": "single"}
    if L.tp == L.pp == L.cp == L.ep == 1:
        if L.dp_shard == 1:
            return {"name": "ddp"}
        return {
            "name": "fsdp",
            "zero_stage": L.zero_stage,
            "replicate": L.dp_replicate,
            "activation_checkpointing": ac,
        }
    spec: dict[str, Any] = {
        "name": "parallel3d", "dp_replicate": L.dp_replicate, "dp_shard": L.dp_shard, "tp": L.tp, "pp": L.pp,
        "cp": L.cp, "ep": L.ep, "sequence_parallel": L.sequence_parallel,
        "zero_stage": L.zero_stage if L.zero_stage in (2, 3) else 3, "activation_checkpointing": ac,
    }  # fmt: skip
    if L.pp > 1:
        spec.update(pp_schedule=SCHEDULE_NAMES[L.pp_schedule], microbatches=L.pp_microbatches)
    return spec
