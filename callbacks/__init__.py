"""Callbacks: code that watches or steers a run at named moments."""

from callbacks.base import Callback
from callbacks.checkpoint import ModelCheckpoint
from callbacks.early_stopping import EarlyStopping
from callbacks.gpu_health import GPUHealthMonitor
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.nan_guard import NaNGuard
from callbacks.phase_times import PhaseTimes
from callbacks.profiler import Profiler
from callbacks.straggler import StragglerDetector
from callbacks.throughput import ThroughputMonitor
from callbacks.timer import Timer

__all__ = [
    "Callback",
    "EarlyStopping",
    "GPUHealthMonitor",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "NaNGuard",
    "PhaseTimes",
    "Profiler",
    "StragglerDetector",
    "ThroughputMonitor",
    "Timer",
]
