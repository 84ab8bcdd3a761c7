"""What `configure_optimizers` may return, in every form Lightning accepts, and when its scheduler steps.

Forms: an optimizer; a list or tuple of them; `([optimizers], [schedulers])` (or one scheduler); a dict
`{"optimizer": ..., "lr_scheduler": scheduler or {"scheduler": ..., "interval": "step" | "epoch",
"frequency": N, "monitor": name, "strict": bool, "name": str}, "monitor": name}`; a list of such dicts.
As in Lightning, a scheduler steps once per epoch unless its interval is "step", and `ReduceLROnPlateau`
is stepped with the value of its `monitor` metric. Several optimizers need manual optimization (the module
steps them, and its schedulers, itself: trainer/loop/manual_step.py); automatic optimization takes one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("trainer")

_SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name")
_ALLOWED = (
    "an optimizer, [optimizers], ([optimizers], [schedulers]), {'optimizer': ..., 'lr_scheduler': ...} or a list "
    "of such dicts"
)


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
    """The optimizer and scheduler configuration of any Lightning return form, for automatic optimization
    (one optimizer, at most one scheduler); a one-line error otherwise."""
    optimizers, schedulers = configured_optimizers(configured, manual=False)
    if len(optimizers) > 1:
        raise TypeError(
            f"configure_optimizers returned {len(optimizers)} optimizers ({_names(optimizers)}); several are "
            "trained with manual optimization only: set `self.automatic_optimization = False` and step them in "
            "training_step (`opt1, opt2 = self.optimizers()`)"
        )
    if len(schedulers) > 1:
        raise TypeError(
            f"configure_optimizers returned {len(schedulers)} lr schedulers; allowed: at most one"
        )
    return optimizers[0], schedulers[0] if schedulers else None


def configured_optimizers(
    configured: Any, *, manual: bool
) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """Every optimizer and scheduler of any Lightning return form, each scheduler attached to one of the
    optimizers. `manual`: the module steps its schedulers itself, so their stepping settings (monitor,
    strict) are not read, as in Lightning's manual optimization."""
    optimizers, entries = _split(configured)
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError(
            f"configure_optimizers returned {_names(optimizers) or 'nothing'}; allowed: {_ALLOWED}"
        )
    schedulers = [_scheduler_config(entry, monitor, manual) for entry, monitor in entries]
    for config in schedulers:
        attached = getattr(config.scheduler, "optimizer", None)
        if attached is not None and not any(attached is o for o in optimizers):
            raise ValueError(
                f"lr scheduler {type(config.scheduler).__name__} steps an optimizer configure_optimizers did not "
                "return; allowed: schedulers of the returned optimizers"
            )
    return optimizers, schedulers


def _names(optimizers: list[Any]) -> str:
    return ", ".join(type(o).__name__ for o in optimizers)


def _split(configured: Any) -> tuple[list[Any], list[tuple[Any, str | None]]]:
    """(optimizers, [(scheduler entry, the monitor named beside it)]) of a return form."""
    if isinstance(configured, dict):
        if "optimizer" not in configured:
            raise TypeError(f"configure_optimizers returned a dict without 'optimizer'; allowed: {_ALLOWED}")
        scheduler = configured.get("lr_scheduler")
        entries = [] if scheduler is None else [(scheduler, configured.get("monitor"))]
        return [configured["optimizer"]], entries
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and isinstance(configured[0], (list, tuple)):  # ([optimizers], [schedulers])
            schedulers = configured[1] if isinstance(configured[1], (list, tuple)) else [configured[1]]
            return list(configured[0]), [(s, None) for s in schedulers]
        if configured and all(isinstance(c, dict) for c in configured):
            parts = [_split(c) for c in configured]
            return [o for p in parts for o in p[0]], [e for p in parts for e in p[1]]
        return list(configured), []
    return [configured], []


def _scheduler_config(entry: Any, monitor: str | None, manual: bool) -> SchedulerConfig:
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
    if config.needs_metric and config.monitor is None and not manual:
        raise ValueError(
            "ReduceLROnPlateau needs the metric it watches: add 'monitor': 'val/loss' (or a name you log) to "
            "the lr_scheduler config or the returned dict"
        )
    return config
