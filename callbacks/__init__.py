"""Callbacks: code that watches or steers a run at named moments."""

from callbacks.base import Callback, Checkpoint
from callbacks.batch_size_finder import BatchSizeFinder
from callbacks.checkpoint import ModelCheckpoint
from callbacks.device_stats import DeviceStatsMonitor
from callbacks.early_stopping import EarlyStopping
from callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from callbacks.gpu_health import GPUHealthMonitor
from callbacks.gradient_accumulation import GradientAccumulationScheduler
from callbacks.gradient_noise_scale import GradientNoiseScale
from callbacks.lambda_callback import LambdaCallback
from callbacks.lr_finder import LearningRateFinder
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.model_summary import ModelSummary
from callbacks.nan_guard import NaNGuard
from callbacks.on_exception_checkpoint import OnExceptionCheckpoint
from callbacks.phase_times import PhaseTimes
from callbacks.prediction_writer import BasePredictionWriter
from callbacks.profiler import Profiler
from callbacks.progress_bars import ProgressBar, RichProgressBar, TQDMProgressBar
from callbacks.pruning import ModelPruning
from callbacks.rich_model_summary import RichModelSummary
from callbacks.spike_detection import SpikeDetection
from callbacks.stochastic_weight_avg import StochasticWeightAveraging
from callbacks.straggler import StragglerDetector
from callbacks.throughput import ThroughputMonitor
from callbacks.timer import Timer
from callbacks.weight_averaging import EMAWeightAveraging, WeightAveraging

__all__ = [
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "BatchSizeFinder",
    "Callback",
    "Checkpoint",
    "DeviceStatsMonitor",
    "EMAWeightAveraging",
    "EarlyStopping",
    "GPUHealthMonitor",
    "GradientAccumulationScheduler",
    "GradientNoiseScale",
    "LambdaCallback",
    "LearningRateFinder",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelPruning",
    "ModelSummary",
    "NaNGuard",
    "OnExceptionCheckpoint",
    "PhaseTimes",
    "Profiler",
    "ProgressBar",
    "RichModelSummary",
    "RichProgressBar",
    "SpikeDetection",
    "StochasticWeightAveraging",
    "StragglerDetector",
    "TQDMProgressBar",
    "ThroughputMonitor",
    "Timer",
    "WeightAveraging",
]
