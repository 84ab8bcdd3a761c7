"""A one-process replica group's calls to torchft without what torchft adds per call: its own commit vote,
and the gradient buckets' sum straight on torchft's process group."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class OwnVote:
    """torchft's manager client, whose commit vote of a one-process group is that process's own: torchft
    0.2.0 asks the group's manager server to agree the group's ranks (a round trip per step, ~0.4-1 ms on a
    loaded machine), which with one rank answers the vote it was given. Everything else goes to `client`."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        """The group's decision: its one rank's vote."""
        return should_commit

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


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
