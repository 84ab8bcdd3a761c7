"""How often to checkpoint, from what a save costs and how often the job fails (Young 1974, "A first order
approximation to the optimum checkpoint interval"; Daly 2006 refines it for large costs). One place: both
`ModelCheckpoint(every_n_steps="auto")` and `trainer plan` use it.

With a save of C seconds every T seconds of training and failures every M seconds on average (the job's
MTBF: a node's MTBF over the number of nodes), a run loses C/T to saving and, per failure, the T/2 of work
since the last save plus the restart R. The loss C/T + (T/2 + R)/M is least at T = sqrt(2 C M)."""

from __future__ import annotations

import math


def young_daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that waste the least time: sqrt(2 * save_cost_s * mtbf_s)
    (Young's first-order optimum, which Daly's higher-order one approaches while the save cost is small
    against the MTBF)."""
    _seconds("save_cost_s", save_cost_s)
    _seconds("mtbf_s", mtbf_s, positive=True)
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def effective_fraction(save_cost_s: float, interval_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The projected share of wall time that trains, checkpointing every `interval_s` seconds of training:
    1 - C/T - (T/2 + R)/M (first order, as the interval; 0 when the losses exceed the time)."""
    _seconds("save_cost_s", save_cost_s)
    _seconds("interval_s", interval_s, positive=True)
    _seconds("mtbf_s", mtbf_s, positive=True)
    _seconds("restart_s", restart_s)
    return max(0.0, 1.0 - save_cost_s / interval_s - (interval_s / 2.0 + restart_s) / mtbf_s)


def _seconds(name: str, value: float, positive: bool = False) -> None:
    """A one-line ValueError unless `value` is a finite number of seconds >= 0 (> 0 if `positive`)."""
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not number or value < 0 or (positive and value == 0):
        raise ValueError(
            f"{name}={value!r} is invalid; allowed: a finite number of seconds {'>' if positive else '>='} 0"
        )
