"""Strategy names used in recipes and `Trainer(strategy="...")`, mapped to their classes."""

from __future__ import annotations

from typing import Any

from strategies.base import Strategy
from strategies.single import SingleDeviceStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDeviceStrategy,
    "auto": SingleDeviceStrategy,
}


def build_strategy(spec: str | Strategy, **kwargs: Any) -> Strategy:
    """A Strategy from a registered name (with constructor kwargs) or an instance given as is."""
    if isinstance(spec, Strategy):
        return spec
    if not isinstance(spec, str) or spec not in STRATEGIES:
        raise ValueError(
            f"strategy={spec!r} is unknown; allowed: {', '.join(sorted(STRATEGIES))} or a Strategy instance"
        )
    return STRATEGIES[spec](**kwargs)
