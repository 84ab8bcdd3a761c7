"""What `TrainModule.log` records: running means per name, reduced over ranks when asked."""

from __future__ import annotations

from collections.abc import Callable

import torch


class MetricBuffer:
    """Sums and counts of logged values since the last `compute`; tensors stay on device until then."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor | float] = {}
        self._counts: dict[str, int] = {}
        self.sync_names: set[str] = set()
        self.prog_bar_names: set[str] = set()

    def add(
        self, name: str, value: float | torch.Tensor, prog_bar: bool = False, sync_dist: bool = False
    ) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"log({name!r}) got a tensor of shape {tuple(value.shape)}; allowed: a scalar"
                )
            value = value.detach().float().reshape(())
        elif not isinstance(value, (int, float)):
            raise TypeError(f"log({name!r}) got a {type(value).__name__}; allowed: a number or scalar tensor")
        self._sums[name] = self._sums.get(name, 0.0) + value
        self._counts[name] = self._counts.get(name, 0) + 1
        if sync_dist:
            self.sync_names.add(name)
        if prog_bar:
            self.prog_bar_names.add(name)

    def compute(self, reduce_mean: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """Means since the last reset; `sync_dist` names go through one all-reduce together."""
        means = {n: torch.as_tensor(s, dtype=torch.float32) / self._counts[n] for n, s in self._sums.items()}
        synced = sorted(n for n in means if n in self.sync_names)
        if synced:
            device = means[synced[0]].device
            reduced = reduce_mean(torch.stack([means[n].to(device) for n in synced]))
            means.update(zip(synced, reduced.unbind(0), strict=True))
        return {n: float(v) for n, v in means.items()}

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()
