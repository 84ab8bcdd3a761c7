"""SingleDeviceStrategy: one process, one device: the base behaviour, named."""

from __future__ import annotations

from strategies.base import Strategy
from trainer.precision import Precision


class SingleDeviceStrategy(Strategy):
    """Train in this process on one device (the CPU, or `cuda:LOCAL_RANK`'s GPU)."""

    name = "single"

    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: Precision) -> None:
        if devices != 1 or num_nodes != 1:
            raise ValueError(
                f"strategy 'single' runs one process, got devices={devices}, num_nodes={num_nodes}; "
                "allowed: devices=1, num_nodes=1 (use a multi-process strategy for more)"
            )
        super().configure(accelerator, devices, num_nodes, precision)
