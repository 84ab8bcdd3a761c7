"""SingleDeviceStrategy: one process, one device: the base behaviour, named."""

from __future__ import annotations

import os

import torch

from strategies.base import Strategy
from trainer import flags
from trainer.precision import Precision


class SingleDeviceStrategy(Strategy):
    """Train in this process on one device: the CPU, or with accelerator "cuda" the GPU of `devices=[i]`,
    else `cuda:LOCAL_RANK` (0 outside a launcher)."""

    name = "single"

    def configure(
        self,
        accelerator: str,
        devices: int,
        num_nodes: int,
        precision: Precision,
        device_ids: list[int] | None = None,
    ) -> None:
        if devices != 1 or num_nodes != 1:
            raise ValueError(
                f"strategy 'single' runs one process, got devices={devices}, num_nodes={num_nodes}; "
                "allowed: devices=1, num_nodes=1 (use a multi-process strategy for more)"
            )
        super().configure(accelerator, devices, num_nodes, precision, device_ids)
        # one process holds the list's only GPU, whatever rank a launcher gave it
        local_rank = 0 if device_ids else int(os.environ.get("LOCAL_RANK", 0))
        self._device = flags.device_for(accelerator, device_ids, local_rank)

    def setup_environment(self) -> None:
        """Make the chosen GPU the current one, so CUDA calls without a device index use it too."""
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
