"""Learning-rate schedules as multipliers of the peak lr, one value per optimizer step.

Every schedule starts with a linear warmup: step s < W uses (s + 1) / W of the peak, so the first
update is already non-zero and step W - 1 reaches the peak. After warmup, with T the total number of
optimizer steps, r = min_lr_ratio and p = (s - W) / (T - W) the decay progress clipped to [0, 1]:

    constant  1
    linear    1 - (1 - r) * p
    cosine    r + (1 - r) * (1 + cos(pi * p)) / 2
    wsd       1 until the last `decay_fraction` of T, then linear to r over that window
              (warmup-stable-decay, MiniCPM; lets a run be extended or branched before the decay)

The scheduler is stepped once per optimizer step, never per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULES = ("constant", "linear", "cosine", "wsd")


@dataclass
class LRSchedule:
    """A picklable lr multiplier (LambdaLR stores its fields in the checkpoint)."""

    name: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"lr_schedule={self.name!r} is unknown; allowed: {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} is invalid; allowed: an int >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} is invalid; allowed: a float in [0, 1]")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction={self.decay_fraction} is invalid; allowed: a float in (0, 1]")
        if self.name != "constant" and self.warmup_steps >= self.total_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} leaves no room to decay in {self.total_steps} total steps; "
                "allowed: warmup_steps < max_steps"
            )

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        r = self.min_lr_ratio
        if self.name == "constant":
            return 1.0
        if self.name == "wsd":
            decay_start = max(
                self.warmup_steps, self.total_steps - round(self.decay_fraction * self.total_steps)
            )
            p = (
                min(1.0, (step - decay_start) / max(1, self.total_steps - decay_start))
                if step >= decay_start
                else 0.0
            )
            return 1.0 - (1.0 - r) * p
        p = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        if self.name == "linear":
            return 1.0 - (1.0 - r) * p
        return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))


class ScheduleLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR over the param groups the optimizer had when it was built. A group added later (a fine-tuning
    callback's `unfreeze_and_add_param_group`) keeps the LR it was given, as it does in Lightning without a
    scheduler; torch's LambdaLR would fail at its next step on the group count."""

    def get_lr(self) -> list[float]:
        lrs = super().get_lr()
        return lrs + [group["lr"] for group in self.optimizer.param_groups[len(lrs) :]]


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> ScheduleLR:
    """Attach `schedule` to every param group of `optimizer` (each group keeps its own peak lr)."""
    return ScheduleLR(optimizer, schedule)
