"""A replica group's calls to torchft without what torchft adds per call: its commit vote taken without its
manager server (a one-process group's own, a group of several processes' over its own process group: in
the all-reduce of the gradients' norm where one spans the group, around a DDP group's ring with the last
bucket or with its token count, in the reduce-scatter of an FSDP2 group's last unit, else an all-reduce of its
own), and the gradient buckets' sum straight on
torchft's process group."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class OwnVote:
    """torchft's manager client, whose commit vote of a one-process group is that process's own: torchft
    0.2.0 asks the group's manager server to agree the group's ranks (a round trip per step, ~0.4-1 ms on a
    loaded machine), which with one rank answers the vote it was given. Everything else goes to `client`.
    `wants_quorum` (set before the vote): this rank asks for a quorum at the next step (quorum_every);
    `group_wants_quorum` (after it): some rank of the group does."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.wants_quorum = self.group_wants_quorum = False
        self.summed: torch.Tensor | None = None  # this step's `terms`, summed over the group already

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        """The group's decision: its one rank's vote."""
        self.group_wants_quorum = self.wants_quorum
        return should_commit

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class GroupVote(OwnVote):
    """torchft's manager client, whose commit vote of a group of several processes is one all-reduce over the
    group's own (default) process group, already connected, instead of each rank's round trip to rank 0's
    manager server (either takes 1.2-5 ms a step in groups of 2 on 2 cores, most of it waiting for the slower
    rank: bench/fault_tolerance.py --group-size 2). The same sum tells every rank whether any wants a
    quorum at the next step (quorum_every), so they all ask alike."""

    def __init__(self, client: Any, device: torch.device) -> None:
        super().__init__(client)
        self.device = device

    def terms(self, should_commit: bool) -> torch.Tensor:
        """This rank's terms of the group's sums: a vote against the step, a wish for a quorum."""
        return torch.tensor([float(not should_commit), float(self.wants_quorum)], device=self.device)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        """Every rank of the group voted for the step (the sums of `summed`, where the step's norm, a DDP
        group's ring or its token count carried them; else one all-reduce now). A rank that does not answer
        within `timeout` raises (its group has lost a process: torchrun restarts it)."""
        votes, self.summed = self.summed, None
        if votes is None:
            votes = self.terms(should_commit)
            dist.all_reduce(votes, async_op=True).wait(timeout)
        against, wants = votes.tolist()
        self.group_wants_quorum = wants > 0
        return against == 0


class DirectSum:
    """The buckets' sum over the groups straight on torchft's process group, as `manager.allreduce` runs it
    (a group that has failed sends nothing; one not participating sends zeros; an error is recorded for
    `commit`, never raised) without what it adds per call on top: a future chain, a timer on torchft's
    event-loop thread (the process group has its own timeout), a division after the reduce."""

    def __init__(self, manager: Any, pg: Any) -> None:
        self.manager, self.pg = manager, pg

    def allreduce(self, tensor: torch.Tensor, reduce_op: dist.ReduceOp) -> _RecordedWork:
        """Launch the sum of `tensor` over the participating groups."""
        manager = self.manager
        if manager.errored() is not None:
            return _RecordedWork(manager, None)  # the step is discarded: no collective after a failure
        if not manager.is_participating():
            tensor.zero_()
        options = dist.AllreduceOptions()
        options.reduceOp = reduce_op
        try:
            return _RecordedWork(manager, self.pg.allreduce([tensor], options))
        except Exception as err:
            manager.report_error(err)
            return _RecordedWork(manager, None)


class _RecordedWork:
    """A launched all-reduce whose failure goes to the manager's record (the step is then discarded)."""

    def __init__(self, manager: Any, work: Any) -> None:
        self.manager, self.work = manager, work

    def wait(self) -> bool:
        """Wait for it; False (and the error recorded) when it failed or never launched."""
        if self.work is None:
            return False
        try:
            self.work.wait()
        except Exception as err:
            self.manager.report_error(err)
            return False
        return True
