"""`max_time` agreed by every rank without a collective per step. Clocks differ per rank, so the ranks
compare them (the slowest's elapsed time) only at agreed steps: each agreement schedules the next where,
at the pace measured so far, half of the time then left will have passed (at most `MAX_INTERVAL` steps
on). The checks thicken towards the limit and fall on every step once less than two steps' time is
left, so the fit stops within about a step of the limit while its pace holds; a fit of S steps agrees
about log2(S) + S / MAX_INTERVAL times. Every rank computes the schedule from the same agreed numbers,
so all stop at the same step. One process has one clock: it checks every step, without a collective."""

from __future__ import annotations

import math
from collections.abc import Callable

MAX_INTERVAL = 100  # steps between agreements at most: a pace that slows down is noticed in time


class TimeLimit:
    """When the fit has run `max_time` seconds, on every rank at the same step."""

    def __init__(self, max_time: float, start_step: int, agreed: bool) -> None:
        self.max_time, self.start_step, self.agreed = max_time, start_step, agreed
        self.next_check = start_step + 1  # the first pace is known after one step

    def reached(self, step: int, elapsed: float, slowest: Callable[[float], float]) -> bool:
        """Whether the time is up before `step` given this rank's `elapsed` seconds; `slowest(elapsed)` is
        the collective that returns the largest over the ranks (called only at agreed steps, and every
        rank calls it then)."""
        if not self.agreed:
            return elapsed >= self.max_time
        if step < self.next_check:
            return False
        elapsed = slowest(elapsed)
        if elapsed >= self.max_time:
            return True
        per_step = elapsed / max(step - self.start_step, 1)
        half_left = (self.max_time - elapsed) / 2
        steps = math.floor(half_left / per_step) if per_step > 0 else 1
        self.next_check = step + max(1, min(MAX_INTERVAL, steps))
        return False
