"""SingleDeviceStrategy: one process, one device: the base behaviour, named."""

from __future__ import annotations

import os

import torch

from strategies.base import Strategy
from trainer import flags


class SingleDeviceStrategy(Strategy):
    """Train in this process on one device: the CPU, or with accelerator "cuda" the GPU of `devices=[i]`,
    else `cuda:LOCAL_RANK` (0 outside a launcher)."""

    name = "single"

    def check_configuration(self) -> None:
        if self.devices != 1 or self.num_nodes != 1:
            raise ValueError(
                f"strategy 'single' runs one process, got devices={self.devices}, num_nodes={self.num_nodes}; "
                "allowed: devices=1, num_nodes=1 (use a multi-process strategy for more)"
            )
        # one process holds the list's only GPU, whatever rank a launcher gave it
        local_rank = 0 if self.device_ids else int(os.environ.get("LOCAL_RANK", 0))
        self._device = flags.device_for(self.accelerator, self.device_ids, local_rank)

    def setup_environment(self) -> None:
        """Make the chosen GPU the current one, so CUDA calls without a device index use it too."""
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
