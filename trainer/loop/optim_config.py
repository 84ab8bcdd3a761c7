"""What `configure_optimizers` may return, in every form Lightning accepts, and when its scheduler steps.

Forms: an optimizer; a list or tuple of one; `([optimizer], [scheduler])`; a dict
`{"optimizer": ..., "lr_scheduler": scheduler or {"scheduler": ..., "interval": "step" | "epoch",
"frequency": N, "monitor": name, "strict": bool, "name": str}, "monitor": name}`; a list of one such dict.
As in Lightning, a scheduler steps once per epoch unless its interval is "step", and `ReduceLROnPlateau`
is stepped with the value of its `monitor` metric. Several optimizers need manual optimization, which
this Trainer does not offer: they are refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("trainer")

_SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name")
_ALLOWED = "an optimizer, [optimizer], ([optimizer], [scheduler]), or {'optimizer': ..., 'lr_scheduler': ...}"


@dataclass
class SchedulerConfig:
    """A user's scheduler and Lightning's settings for it."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None

    @property
    def needs_metric(self) -> bool:
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def step(self, count: int, metrics: dict[str, float]) -> None:
        """Called after optimizer step / epoch number `count` (1-based) of the scheduler's interval."""
        if count % self.frequency:
            return
        if not self.needs_metric:
            self.scheduler.step()
            return
        if self.monitor in metrics:
            self.scheduler.step(metrics[self.monitor])
        elif self.strict:
            raise KeyError(
                f"lr scheduler monitor {self.monitor!r} is not among the logged metrics {sorted(metrics)}; allowed: "
                "one of them, or 'strict': False to skip the step when it is missing"
            )
        else:
            log.warning(f"lr scheduler monitor {self.monitor!r} was not logged; the scheduler did not step")


def parse_optimizers(configured: Any) -> tuple[torch.optim.Optimizer, SchedulerConfig | None]:
    """The optimizer and scheduler configuration of any Lightning return form; a one-line error otherwise."""
    optimizers, schedulers, monitor = _split(configured)
    if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.Optimizer):
        found = ", ".join(type(o).__name__ for o in optimizers) or "nothing"
        raise TypeError(
            f"configure_optimizers returned {found}; allowed: {_ALLOWED} (one optimizer: several need manual "
            "optimization, which this Trainer does not offer)"
        )
    if len(schedulers) > 1:
        raise TypeError(
            f"configure_optimizers returned {len(schedulers)} lr schedulers; allowed: at most one"
        )
    if not schedulers:
        return optimizers[0], None
    return optimizers[0], _scheduler_config(schedulers[0], monitor)


def _split(configured: Any) -> tuple[list[Any], list[Any], str | None]:
    if isinstance(configured, dict):
        if "optimizer" not in configured:
            raise TypeError(f"configure_optimizers returned a dict without 'optimizer'; allowed: {_ALLOWED}")
        scheduler = configured.get("lr_scheduler")
        return (
            [configured["optimizer"]],
            [scheduler] if scheduler is not None else [],
            configured.get("monitor"),
        )
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and all(isinstance(c, (list, tuple)) for c in configured):
            return list(configured[0]), list(configured[1]), None  # ([optimizers], [schedulers])
        if len(configured) == 1 and isinstance(configured[0], dict):
            return _split(configured[0])
        return list(configured), [], None
    return [configured], [], None


def _scheduler_config(entry: Any, monitor: str | None) -> SchedulerConfig:
    if not isinstance(entry, dict):
        entry = {"scheduler": entry}
    unknown = sorted(set(entry) - set(_SCHEDULER_KEYS))
    if unknown or "scheduler" not in entry:
        raise TypeError(
            f"lr_scheduler config has keys {sorted(entry)}; allowed: 'scheduler' (required), "
            f"{', '.join(repr(k) for k in _SCHEDULER_KEYS[1:])}"
        )
    config = SchedulerConfig(**{"monitor": monitor, **entry})
    if config.interval not in ("step", "epoch"):
        raise ValueError(f"lr_scheduler interval={config.interval!r} is invalid; allowed: 'step', 'epoch'")
    if isinstance(config.frequency, bool) or not isinstance(config.frequency, int) or config.frequency < 1:
        raise ValueError(f"lr_scheduler frequency={config.frequency!r} is invalid; allowed: an int >= 1")
    if not callable(getattr(config.scheduler, "step", None)):
        raise TypeError(
            f"lr_scheduler {type(config.scheduler).__name__} has no step(); allowed: a torch.optim.lr_scheduler"
        )
    if config.needs_metric and config.monitor is None:
        raise ValueError(
            "ReduceLROnPlateau needs the metric it watches: add 'monitor': 'val/loss' (or a name you log) to "
            "the lr_scheduler config or the returned dict"
        )
    return config
