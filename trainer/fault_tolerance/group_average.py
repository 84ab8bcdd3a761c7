"""What the overlapped averages inside groups of several processes share (overlap_ddp.py, overlap_fsdp.py):
after the backward, the step's token count summed over the groups and, when the backward's sums are the
average, the loop's token normalization undone on `.grad`; the kept buffer, with slots for terms, of the
gradients summed whole over the groups (`Staged`)."""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch
from torch.distributed import ReduceOp

from trainer.core.dtensors import local_part
from trainer.fault_tolerance.costs import StepCosts


class GroupAverage:
    """The shared arming and end of a step; a subclass resets its own per-step state (`_reset`) and says when
    its sums are waited for (`_wait`) and complete (`_complete`)."""

    # whether the sums' layout is every group's only once each of its processes has run a synced backward
    layout_after_first_backward = False

    def __init__(self, params: list[torch.nn.Parameter], direct: Any, costs: StepCosts | None) -> None:
        self.params, self.direct, self.costs = params, direct, costs or StepCosts()
        self.armed = False
        self.groups = 1
        self.factor = 1.0  # a gradient's factor before the sum over the groups: 1 / groups (x 1 / loss scale)
        self.scale = 1.0  # fp16's loss scale, put back after the sum (DDP's `.grad` is expected scaled)
        # quorum_every's terms (cadence.py), summed over the groups in one of the backward's sums where a short
        # one has slots for them (`flags_ride`), else after one (DDP: its first; FSDP2: its last), their round
        # trip hidden behind the later ones', into `flags`; None: none
        self.terms: torch.Tensor | None = None
        self.terms_work: Any = None
        self.flags = (0.0, 0.0)
        self.flags_taken = False
        # the group's commit vote summed over its processes with the backward's last exchange, from
        # `vote_terms` (this process's, made up once every sum over the groups is done); None: not this step
        self.vote_terms: Callable[[], torch.Tensor] | None = None
        self.voted: torch.Tensor | None = None

    def arm(
        self,
        groups: int,
        backwards: int = 1,
        inv_scale: float = 1.0,
        terms: tuple[float, float] | None = None,
    ) -> None:
        """The step's average is over `groups` groups; `backwards` (its micro-batches) is the strategy's own
        business (DDP's `no_sync`, FSDP's last-backward reduction). `inv_scale`: fp16's 1 / loss scale (1
        under FSDP2, which has no scaler). `terms`: quorum_every's (None: none), sent by `send_terms`."""
        self._reset()
        device = self.params[0].device if self.params else torch.device("cpu")
        self.terms = torch.tensor(terms, dtype=torch.float64, device=device) if terms is not None else None
        self.terms_work, self.flags_taken = None, False
        self.armed = True
        self.groups, self.factor, self.scale = groups, inv_scale / groups, 1.0 / inv_scale

    def send_terms(self) -> None:
        """Launch the terms' sum over the groups (once a step, at the same place in every group)."""
        if self.terms is not None and self.terms_work is None:
            self.terms_work = self.direct.allreduce(self.terms, ReduceOp.SUM)

    def flags_ride(self, dtype: torch.dtype) -> bool:
        """Whether quorum_every's terms, not sent yet, may go in a sum over the groups in `dtype`: one that
        counts every group exactly (bf16 to 256, fp16 to 2048)."""
        return (
            self.terms is not None and self.terms_work is None and self.groups <= 2 / torch.finfo(dtype).eps
        )

    def take_flags(self) -> None:
        """Wait for the terms' sum (once a step) into `flags`: its failure is recorded for `commit`, the
        sums are then garbage."""
        if self.terms is not None and not self.flags_taken:
            self.flags_taken = True
            self.terms_work.wait()
            self.flags = tuple(self.terms.tolist())

    def finish(self, use: bool, undo: float = 1.0, extra: torch.Tensor | None = None) -> bool:
        """After the backward: `extra` (the step's token count) summed over the groups in place; with `use`,
        `.grad` x `undo` (the loop's token normalization since the backward: the sums hold the token sums'
        mean). False when the gradients are not the average (not `use`, or `_complete` says no: the caller
        then averages after the backward)."""
        if not self.armed:
            return False
        self.armed = False
        start = perf_counter()
        self.send_terms()  # where the backward did not (it launched no sum)
        summed = self.direct.allreduce(extra, ReduceOp.SUM) if extra is not None else None
        self._wait()
        if summed is not None:
            summed.wait()
        self.take_flags()
        start = self.costs.add("allreduce", start)
        if not (use and self._complete()):
            return False
        if undo != 1.0:
            torch._foreach_mul_([local_part(p.grad) for p in self.params if p.grad is not None], undo)
            self.costs.add("copies", start)
        return True

    def _reset(self) -> None:
        """Clear the subclass's per-step state (at `arm`)."""
        raise NotImplementedError

    def _wait(self) -> None:
        """Wait for the sums the backward launched and did not wait for itself."""

    def _complete(self) -> bool:
        raise NotImplementedError


class Staged:
    """A (rows, n + 2) buffer, each row n gradients and 2 slots for terms (a vote's, quorum_every's), and its
    views, made once and kept while its rows, length, dtype and device hold (`kept`): on a CPU each view or
    allocation a step makes costs about as much as the copy of a short bucket it serves."""

    def __init__(self, rows: int, n: int, like: torch.Tensor) -> None:
        self.made_for = (rows, n, like.dtype, like.device)
        self.whole = like.new_zeros(rows, n + 2)
        self.flat = self.whole.view(-1)
        self.grads = self.whole[:, :n]
        self.first = self.whole[0, :n]  # the first row's gradients
        self.slots = self.whole[:, n:]  # every row's terms
        self.terms = self.whole[0, n:]  # the first row's

    @classmethod
    def kept(cls, staged: Staged | None, rows: int, n: int, like: torch.Tensor) -> Staged:
        """`staged` where it has this shape and `like`'s dtype and device, else a new one."""
        if staged is not None and staged.made_for == (rows, n, like.dtype, like.device):
            return staged
        return cls(rows, n, like)
