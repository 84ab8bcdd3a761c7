"""Parallelism strategies: how a run's work is spread over processes and devices."""

from strategies.base import Strategy
from strategies.registry import STRATEGIES, build_strategy
from strategies.single import SingleDeviceStrategy

__all__ = ["STRATEGIES", "SingleDeviceStrategy", "Strategy", "build_strategy"]
