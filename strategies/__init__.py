"""Parallelism strategies: how a run's work is spread over processes and devices."""

from strategies.base import Strategy
from strategies.ddp import DDPStrategy
from strategies.dp_sgd import DPSGDStrategy  # the registry imports it anyway (its "dp_sgd" name)
from strategies.fsdp import FSDPStrategy
from strategies.mesh import MeshStrategy
from strategies.parallel import ParallelStrategy
from strategies.parallel3d import Parallel3DStrategy
from strategies.parallel_dims import Group, ParallelDims
from strategies.parallelize import ParallelOptions
from strategies.registry import STRATEGIES, build_strategy
from strategies.single import SingleDeviceStrategy

__all__ = [
    "STRATEGIES",
    "DDPStrategy",
    "DPSGDStrategy",
    "FSDPStrategy",
    "Group",
    "MeshStrategy",
    "Parallel3DStrategy",
    "ParallelDims",
    "ParallelOptions",
    "ParallelStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "build_strategy",
]
