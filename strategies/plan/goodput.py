"""Effective training time (goodput: the share of wall time whose training is kept) of a run that fails
every `mtbf_s` seconds on average, for three ways of recovering:

- restart from checkpoint: every interruption stops the job; it restarts (rescheduling, start-up, reading the
  last checkpoint) and redoes the work since that checkpoint, saved at Young/Daly's interval
  (checkpoint_interval.py);
- live recovery (torchft replica groups): an interruption takes one of `groups` replica groups; the others
  stall until they notice, drop the step in flight, then train on without it until a replacement node is
  there and the group has rejoined from a peer; every step costs `step_ratio` times a plain step;
- live recovery with hot spares: as live recovery, with a spare node already waiting (no replacement wait).

First order, as Young's interval: losses add up per interruption, interruptions do not overlap a recovery.
A share `job_wide` of the interruptions takes every group (a bug hitting all replicas): those restart from
a checkpoint under live recovery too."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from strategies.plan.checkpoint_interval import effective_fraction, young_daly_interval

# of Llama 3's 466 interruptions (checkpoint_interval.py), 419 were unexpected, 78% of them hardware (Dubey et
# al. 2024, section 3.3.4); the model counts all 466, as a planned one stops a restarting job all the same
LLAMA3_UNEXPECTED = 419
# the seed's 100,000-GPU run "needs a machine that can lose one every half hour": its MTBF, scaled as 1/N
SEED_GPUS, SEED_MTBF_S = 100_000, 1800.0


@dataclass(frozen=True)
class Costs:
    """What one interruption and the protection against it cost, in seconds (`step_ratio`: a factor)."""

    step_s: float  # the planner's step: live recovery drops the one in flight
    save_s: float  # a checkpoint's blocking save
    restore_s: float  # reading the checkpoint back at a restart
    restart_s: float  # relaunching the job: rescheduling, process start-up, communicator set-up
    stall_s: float  # the survivors' wait until they notice a group is gone
    rejoin_s: float  # a relaunched group's start to its first step in the quorum (state from a peer)
    replace_s: float  # waiting for a replacement node when there is no spare
    step_ratio: float  # a live-recovery step over a plain one (quorum, commit vote, copies)
    groups: int  # replica groups
    job_wide: float = 0.0  # the share of interruptions that take every group

    def __post_init__(self) -> None:
        _check("step_s", self.step_s, 0.0, math.inf, "a finite number of seconds > 0", positive=True)
        for name in ("save_s", "restore_s", "restart_s", "stall_s", "rejoin_s", "replace_s"):
            _check(name, getattr(self, name), 0.0, math.inf, "a finite number of seconds >= 0")
        _check("step_ratio", self.step_ratio, 1.0, math.inf, "a finite number >= 1")
        _check("job_wide", self.job_wide, 0.0, 1.0, "a share from 0 to 1")
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"groups={self.groups!r} is invalid; allowed: an int >= 1")


def checkpoint_every_s(costs: Costs, mtbf_s: float) -> float:
    """Seconds of training between checkpoints: Young/Daly's interval, at least one step."""
    return max(young_daly_interval(costs.save_s, mtbf_s), costs.step_s)


def restart_goodput(costs: Costs, mtbf_s: float) -> float:
    """Restart from checkpoint: 1 - C/T - (T/2 + restart + restore) / MTBF at Young/Daly's T."""
    interval = checkpoint_every_s(costs, mtbf_s)
    return effective_fraction(costs.save_s, interval, mtbf_s, costs.restart_s + costs.restore_s)


def live_goodput(costs: Costs, mtbf_s: float, spares: bool = False) -> float:
    """Live recovery (hot spares: no replacement wait): per group lost, every group stalls and drops a
    step, then 1/groups of the throughput waits for the replacement and the rejoin; job-wide interruptions
    restart from a checkpoint saved at their own Young/Daly interval; every step costs step_ratio."""
    _check("mtbf_s", mtbf_s, 0.0, math.inf, "a finite number of seconds > 0", positive=True)
    if costs.groups < 2:
        raise ValueError(f"groups={costs.groups}: live recovery needs a surviving group; allowed: >= 2")
    wait = (0.0 if spares else costs.replace_s) + costs.rejoin_s
    group_lost = costs.stall_s + costs.step_s + wait / costs.groups
    lost = (1.0 - costs.job_wide) * group_lost / mtbf_s
    if costs.job_wide > 0:  # those restart: checkpoints are taken for them alone
        lost += 1.0 - restart_goodput(costs, mtbf_s / costs.job_wide)
    return max(0.0, 1.0 - lost) / costs.step_ratio


def break_even_ratio(costs: Costs, mtbf_s: float, target: float) -> float:
    """The largest per-step ratio at which live recovery (no spares) still reaches `target` goodput."""
    _check("target", target, 0.0, 1.0, "a share in (0, 1]", positive=True)
    return live_goodput(replace(costs, step_ratio=1.0), mtbf_s) / target


def seed_mtbf_s(gpus: int) -> float:
    """The job's MTBF at `gpus` at the seed's rate, one interruption every half hour at 100,000 GPUs,
    scaled as 1 / gpus (failures independent per GPU, as `llama3_mtbf_s`)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} is invalid; allowed: an int >= 1")
    return SEED_MTBF_S * SEED_GPUS / gpus


def _check(name: str, value: float, low: float, high: float, allowed: str, positive: bool = False) -> None:
    """A one-line ValueError unless `value` is a finite number in [low, high] (above low if `positive`)."""
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not number or not low <= value <= high or (positive and value == low):
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")
