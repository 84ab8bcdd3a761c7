"""Callbacks: code that watches or steers a run at named moments."""

from callbacks.base import Callback
from callbacks.checkpoint import ModelCheckpoint
from callbacks.early_stopping import EarlyStopping
from callbacks.gpu_health import GPUHealthMonitor
from callbacks.gradient_accumulation import GradientAccumulationScheduler
from callbacks.lambda_callback import LambdaCallback
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.nan_guard import NaNGuard
from callbacks.on_exception_checkpoint import OnExceptionCheckpoint
from callbacks.prediction_writer import BasePredictionWriter
from callbacks.profiler import Profiler
from callbacks.straggler import StragglerDetector
from callbacks.throughput import ThroughputMonitor
from callbacks.timer import Timer

__all__ = [
    "BasePredictionWriter",
    "Callback",
    "EarlyStopping",
    "GPUHealthMonitor",
    "GradientAccumulationScheduler",
    "LambdaCallback",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "NaNGuard",
    "OnExceptionCheckpoint",
    "Profiler",
    "StragglerDetector",
    "ThroughputMonitor",
    "Timer",
]
