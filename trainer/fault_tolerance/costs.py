"""Where a replica group's per-step fault-tolerance work goes: running seconds per part on this rank."""

from __future__ import annotations

from time import perf_counter

# quorum: waiting for this step's quorum (and a recovery); allreduce: launching the cross-group averages
# and waiting for them; commit: the commit vote; copies: gradients into and out of the reduce buffers
PARTS = ("quorum", "allreduce", "commit", "copies")


class StepCosts:
    """Running seconds per part since the replica group started (subtract two snapshots for a window)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PARTS, 0.0)

    def add(self, part: str, since: float) -> float:
        """Count the time from `since` (a `perf_counter()`) to now for `part`; now, for the next part."""
        now = perf_counter()
        self.seconds[part] += now - since
        return now
