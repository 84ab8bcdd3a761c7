"""Strategy names used in recipes and `Trainer(strategy="...")`, mapped to their classes."""

from __future__ import annotations

from typing import Any

from strategies.base import Strategy
from strategies.ddp import DDPStrategy
from strategies.dp_sgd import DPSGDStrategy
from strategies.fsdp import FSDPStrategy
from strategies.parallel3d import Parallel3DStrategy
from strategies.single import SingleDeviceStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "parallel3d": Parallel3DStrategy,
    "dp_sgd": DPSGDStrategy,
}
NAMES = ("auto", *STRATEGIES)


def build_strategy(spec: str | Strategy, processes: int = 1, **kwargs: Any) -> Strategy:
    """A Strategy from a registered name (with constructor kwargs) or an instance given as is.
    "auto" is "single" for one process and "ddp" for more."""
    if isinstance(spec, Strategy):
        return spec
    if spec == "auto":
        spec = "single" if processes == 1 else "ddp"
    if not isinstance(spec, str) or spec not in STRATEGIES:
        raise ValueError(f"strategy={spec!r} is unknown; allowed: {', '.join(NAMES)} or a Strategy instance")
    return STRATEGIES[spec](**kwargs)
