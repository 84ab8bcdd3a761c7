"""A quorum every k steps while the replica groups stay in step (`FaultTolerance(quorum_every=k)`), for groups
whose backward averages over the groups (one process, DDP or FSDP2): the per-step quorum is most of what
fault tolerance costs a short step (three torchft threads and the lighthouse woken every step: bench MLP
width 256, 1.12-1.26x plain DDP per step, 1.01-1.14x with k=8 over three runs on 2 cores). Between quorums
the groups keep the last one's process group and participants; what the quorum would have caught is caught
as follows, every group deciding alike from what all of them see, and every rank of a group alike from its
commit vote (which sums whether any rank asks for a quorum: group_calls.GroupVote):

- a peer that dies: the step's all-reduce fails (a closed connection), the group discards the step and asks
  for a quorum at the next (a peer that hangs: after `timeout_s`, as with a quorum every step);
- a group that did not apply a step its peers applied (a callback's skip): its flag in the next step's
  all-reduce (one process: summed in the last gradient bucket; several: summed right after the first
  (DDP) or the last (FSDP2) bucket's sum, its round trip behind the later ones') is 0, so every group
  discards that step and asks for a quorum at the one after, where the group behind recovers from a peer;
- a group that joins or comes back: the lighthouse holds its quorum until the others ask, at most k steps
  later, or `max_interval_s` (plus two steps) where k steps take longer: a group whose last quorum is that
  old wishes for one in the step's sums, and every group asks at the next step. (The lighthouse's join
  timeout, 60 s by default, must be longer: past it, the joiner's quorum forms without the others.)
"""

from __future__ import annotations

import time
from collections.abc import Callable


class QuorumCadence:
    """Which steps ask for a quorum: every `every`-th step of the loop (the same in every group in step), and
    the one after a step that failed, that the sums showed one group out of step, or where a group wished
    for one (its last is `max_interval_s` old)."""

    def __init__(
        self, every: int, max_interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every, self.max_interval_s, self.clock = every, max_interval_s, clock
        self.due_next = True  # the first step asks (this process's first quorum)
        self.in_step = True  # this group applied every step its peers applied since the last quorum
        self.last_quorum = clock()

    def due(self, step: int) -> bool:
        """Whether step `step` asks for a quorum."""
        return self.due_next or step % self.every == 0

    def asked(self) -> None:
        """This step joined a quorum: every group of it is in step (a group behind recovered)."""
        self.due_next, self.in_step, self.last_quorum = False, True, self.clock()

    def terms(self) -> tuple[float, float]:
        """This group's terms in the step's two sums over the groups: 1 when in step with its peers; 1 when
        it wishes for a quorum at the next step (its last is `max_interval_s` old)."""
        wish = self.clock() - self.last_quorum >= self.max_interval_s
        return 1.0 if self.in_step else 0.0, 1.0 if wish else 0.0

    def agreed(self, sums: tuple[float, float], participants: int) -> bool:
        """Whether every participating group was in step (`sums`: of their `terms`); if not, every group
        discards this step and asks for a quorum at the next, as it does when one wished for it."""
        in_step, wishes = sums
        if in_step > participants - 0.5:
            self.due_next = self.due_next or wishes > 0.5
            return True
        self.due_next = True
        return False

    def committed(self, committed: bool, failed: bool) -> None:
        """After the commit vote: a group that did not apply the step is out of step (the next step's flags
        say so); one whose collectives failed (a peer died) asks for a quorum at once."""
        self.in_step = self.in_step and committed
        self.due_next = self.due_next or failed
