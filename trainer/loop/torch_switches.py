"""The process-wide torch switches a stage sets from the Trainer's flags and puts back after it, so that a
Trainer leaves the process as it found it: deterministic algorithms (`deterministic`, "warn" included),
cuDNN's autotuner (`benchmark`) and autograd's anomaly detection (`detect_anomaly`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer.trainer import Trainer


@dataclass(frozen=True)
class TorchSwitches:
    """The switches' values at one moment."""

    deterministic: bool
    warn_only: bool  # deterministic where torch can, a warning (not an error) where it cannot
    benchmark: bool
    anomaly: bool
    anomaly_check_nan: bool

    @classmethod
    def now(cls) -> TorchSwitches:
        return cls(
            deterministic=torch.are_deterministic_algorithms_enabled(),
            warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            benchmark=torch.backends.cudnn.benchmark,
            anomaly=torch.is_anomaly_enabled(),
            anomaly_check_nan=torch.is_anomaly_check_nan_enabled(),
        )

    def apply(self) -> None:
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)
        torch.backends.cudnn.benchmark = self.benchmark
        torch.set_anomaly_enabled(self.anomaly, self.anomaly_check_nan)


def set_for_stage(trainer: Trainer) -> TorchSwitches:
    """The switches as the Trainer's flags ask (a flag left unset leaves its switch as it is); returns the
    ones they replaced, which `apply()` puts back."""
    before = TorchSwitches.now()
    deterministic = trainer.deterministic
    TorchSwitches(
        deterministic=bool(deterministic) or before.deterministic,
        warn_only=deterministic == "warn" if deterministic else before.warn_only,
        benchmark=before.benchmark if trainer.benchmark is None else trainer.benchmark,
        anomaly=trainer.detect_anomaly or before.anomaly,
        # Lightning's set_detect_anomaly(True): a backward that returns NaN raises
        anomaly_check_nan=trainer.detect_anomaly or before.anomaly_check_nan,
    ).apply()
    return before
