"""DeviceStatsMonitor: the device's memory (CUDA) or the host's CPU, memory and swap use, logged around each
training, validation and test batch (Lightning's)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class DeviceStatsMonitor(Callback):
    """Logs `DeviceStatsMonitor.<hook>/<stat>` straight to the loggers (not `callback_metrics`), on rows the
    Trainer logs (`log_every_n_steps`; an evaluation's every n-th batch), at the step count of the moment. On
    CUDA the stats are `torch.cuda.memory_stats`; on the CPU psutil's `cpu_percent`, `cpu_vm_percent` and
    `cpu_swap_percent`. `cpu_stats`: None logs the CPU's only when it is the device, True also beside CUDA's,
    False never."""

    def __init__(self, cpu_stats: bool | None = None) -> None:
        self._cpu_stats = cpu_stats
        self._log_step = False  # the training step in progress writes a row

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if stage != "fit":
            return
        on_cpu = trainer.strategy.root_device.type == "cpu"
        wants_cpu = self._cpu_stats or (self._cpu_stats is None and on_cpu)
        if wants_cpu and importlib.util.find_spec("psutil") is None:
            raise ModuleNotFoundError(
                "DeviceStatsMonitor needs the `psutil` package for CPU stats; install it: pip install psutil"
            )

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        self._log_step = trainer.logs_this_step
        self._log(trainer, "on_train_batch_start", self._log_step)

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        self._log(trainer, "on_train_batch_end", self._log_step)

    def on_validation_batch_start(
        self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._log(trainer, "on_validation_batch_start", self._eval_row(trainer, batch_idx))

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._log(trainer, "on_validation_batch_end", self._eval_row(trainer, batch_idx))

    def on_test_batch_start(
        self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._log(trainer, "on_test_batch_start", self._eval_row(trainer, batch_idx))

    def on_test_batch_end(
        self,
        trainer: Trainer,
        module: TrainModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._log(trainer, "on_test_batch_end", self._eval_row(trainer, batch_idx))

    @staticmethod
    def _eval_row(trainer: Trainer, batch_idx: int) -> bool:
        """An evaluation logs its every `log_every_n_steps`-th batch, as Lightning counts them."""
        return (batch_idx + 1) % trainer.log_every_n_steps == 0

    def _log(self, trainer: Trainer, hook: str, due: bool) -> None:
        device = trainer.strategy.root_device
        # rank zero's device speaks for the run, as Lightning's loggers write rank zero's only
        if not due or not trainer.is_global_zero or (self._cpu_stats is False and device.type == "cpu"):
            return
        stats: dict[str, float] = {}
        if device.type == "cuda":
            stats.update(torch.cuda.memory_stats(device))
        if self._cpu_stats or device.type == "cpu":
            stats.update(cpu_stats())
        prefix = f"{type(self).__qualname__}.{hook}/"
        for logger in trainer.loggers:
            logger.log_metrics({prefix + k: v for k, v in stats.items()}, trainer.global_step)


def cpu_stats() -> dict[str, float]:
    """The host's CPU use, memory use and swap use in percent (psutil's, system-wide)."""
    import psutil

    return {
        "cpu_vm_percent": psutil.virtual_memory().percent,
        "cpu_percent": psutil.cpu_percent(),
        "cpu_swap_percent": psutil.swap_memory().percent,
    }
