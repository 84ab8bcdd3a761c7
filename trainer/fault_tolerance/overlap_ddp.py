"""The cross-group gradient average overlapped with the backward for a replica group of several DDP processes,
from DDP's comm hook, bucket by bucket. In place of DDP's all-reduce over the group (on gloo): the bucket's sum
over the group as each process's slice, the slice summed over the replica groups (rank r with rank r of every group,
on torchft's process group), the slices gathered back (ring.py): each process sends 1 / (group size) of the
bucket across the groups. Under a strategy's own hook (gradient compression), and on NCCL: the group's mean,
then the whole bucket summed over the groups. DDP waits for every bucket before its backward returns, so `.grad`
(the buckets' views) holds the average over every process of every group, with no copy after the backward.
Around the ring, the last bucket's slices carry the group's commit vote, made up once every sum over the
groups is done (`vote_terms`): the group's processes agree without a wait of their own after the backward. A
short last bucket (up to ring.PACKED gradients) goes the other way round, in the backward's own thread: summed
over the groups whole, then over the group with the vote (and quorum_every's flags ride the first sum)."""

from __future__ import annotations

import functools
import queue
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from strategies.techniques.ddp.chain import ChainableHook
from trainer.fault_tolerance.costs import StepCosts
from trainer.fault_tolerance.group_average import GroupAverage, Staged
from trainer.fault_tolerance.ring import PACKED, Ring


class OverlappedGroupAverage(GroupAverage):
    """DDP's comm hook on `ddp` that adds each bucket's sum over the replica groups to the group's own
    reduction, while `arm`ed (between the quorum and `finish`; outside, the group's reduction alone). With
    the strategy's own hook (gradient compression, a gradient-noise watch: a `ChainableHook`, which this
    wraps), its mean over the group, x 1 / groups, then summed over the groups; with none (DDP's all-reduce,
    as a `ChainableHook` registered here), around the group's ring: its slice of the group's sum, x 1 /
    (group size x groups), summed over the groups, gathered back. fp16: x 1 / loss scale before the sum
    and x scale after it, so groups whose scales differ average true gradients.

    The sums over the groups launch strictly in bucket order (the ring's thread takes the buckets in DDP's
    order, the backward's own thread the last one once the others are done; a strategy's hooks complete
    on gloo's threads in any order and wait for the earlier buckets), so every group makes the same
    sequence of collectives. Under `no_sync` (gradient accumulation) DDP calls the hook only in the
    window's last backward; a second synced backward in the step marks it stale and the caller averages
    after the backward instead (see `finish`)."""

    # DDP's first synced backward in a process fills one bucket of every parameter; from its second on,
    # buckets in the order the first readied them (DDP rebuilds them)
    layout_after_first_backward = True

    def __init__(self, ddp: DistributedDataParallel, direct: Any, costs: StepCosts | None = None) -> None:
        super().__init__([p for p in ddp.module.parameters() if p.requires_grad], direct, costs)
        self.group = ddp.process_group
        self.group_size = self.group.size()
        self.lock = threading.Lock()  # the gloo threads that complete the group's all-reduces
        self._reset()
        self.chain = next((h for h, _ in ddp._comm_hooks if isinstance(h, ChainableHook)), None)
        if (
            self.chain is None
        ):  # DDP's built-in all-reduce so far (`ddp_to_chain` checked): the same, chainable
            self.chain = ChainableHook(default_hooks.allreduce_hook)
            ddp.register_comm_hook(self.group, self.chain)
        self.chain.around = self._around
        # DDP's own all-reduce: the group's sum as each process's slice, the slice summed over the groups, the
        # slices gathered back (ring.py), on a thread of its own (gloo's point-to-point works have no future)
        self.ring, self.spares = Ring(self.group), {}  # spares: a slice-sized receive buffer per bucket
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pending, self.drained = 0, threading.Condition()  # buckets queued, not yet done
        self.staged: Staged | None = None  # a short last bucket and 2 slots (`_sum_first`)
        threading.Thread(target=self._work, daemon=True, name="trainer-group-ring").start()

    def _reset(self) -> None:
        """The step's buckets: none seen, none summed, the last unknown, no vote carried yet."""
        self.seen: set[int] = set()  # bucket indexes the hook ran for this step
        self.last: int | None = None  # the index of the backward's last bucket
        self.reduced: dict[int, tuple[torch.Tensor, torch.futures.Future, BaseException | None]] = {}
        self.next = 0  # the next bucket to sum over the groups
        self.stale = False
        self.voted: torch.Tensor | None = None

    def _complete(self) -> bool:
        """DDP waited for every bucket in the backward: each went out once, in one synced backward."""
        return self.last is not None and self.next == self.last + 1 and not self.stale

    @property
    def launched(self) -> int:
        """The sums over the groups this step's backward launched (one per bucket)."""
        return self.next

    def remove(self) -> None:
        """The strategy's hook alone again (or DDP's all-reduce, as a Python hook); the ring's thread ends."""
        self.chain.around = None
        self.armed = False
        self.jobs.put(None)

    def _around(self, hook: Any, state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        """The bucket's future: its mean over the group (`hook`'s), then, armed, the sum over the groups of
        that mean x 1 / groups."""
        index = bucket.index()
        if self.armed and index in self.seen:  # a second synced backward: this one stays the group's mean
            self.stale = True
        if not self.armed or self.stale:
            return hook(state, bucket)
        self.seen.add(index)
        if bucket.is_last():
            self.last = index
        out: torch.futures.Future = torch.futures.Future()
        # DDP's own on gloo: around the ring (in bucket order: DDP's); NCCL has native reduce-scatter and
        # all-gather for that (not measured here: no GPU), so its all-reduce goes on as the strategy's hook
        if hook is default_hooks.allreduce_hook and bucket.buffer().device.type == "cpu":
            if bucket.is_last():  # here, once the thread has done the earlier ones: the backward's end then
                # waits for no hand-off to the thread and back (each a wake-up, late on a busy machine)
                with self.drained:
                    self.drained.wait_for(lambda: self.pending == 0)
                if bucket.buffer().numel() <= PACKED:
                    self._sum_first(bucket.buffer(), out)
                else:
                    self._ring_average(bucket.buffer(), out, index)
            else:
                with self.drained:
                    self.pending += 1
                self.jobs.put((bucket.buffer(), out, index))
        else:  # the strategy's (or NCCL's): the group's mean, then the whole bucket summed over the groups
            hook(state, bucket).add_done_callback(functools.partial(self._group_done, out, index))
        return out

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                self._ring_average(*job)
            finally:  # (the backward's last bucket waits for this count)
                with self.drained:
                    self.pending -= 1
                    if not self.pending:
                        self.drained.notify()

    def _ring_average(self, buffer: torch.Tensor, out: torch.futures.Future, index: int) -> None:
        """The bucket's sum over the group as this process's slice, that slice x 1 / (group size x groups)
        summed over the groups (its failure recorded for `commit`), every slice gathered back."""
        last = self.last is not None and index == self.last  # the backward's last bucket
        size = -(-buffer.numel() // self.ring.size)
        spare = self.spares.get(index)
        if spare is None or spare.numel() < size or spare.dtype != buffer.dtype:
            spare = self.spares[index] = buffer.new_empty(size)
        try:
            mine = self.ring.reduce_scatter(buffer, spare, tag=3 * index)
            mine.mul_(self.factor / self.group_size)
            done = self._over_groups(mine, None)
            if done and self.scale != 1.0:
                mine.mul_(self.scale)  # a power of two: the scaled gradient DDP's `.grad` is expected to hold
            votes = None
            if last and self.vote_terms is not None:  # every sum over the groups is done: the vote goes along
                self.take_flags()
                votes = self.vote_terms().to(buffer.dtype)
            self.ring.all_gather(buffer, tag=3 * index + 1, terms=votes)  # (votes: 3 * index + 2)
            self.voted = votes
        except Exception as err:  # the group's own exchange (a process of it died): DDP raises it
            out.set_exception(err)
            return
        out.set_result(buffer)

    def _over_groups(self, tensor: torch.Tensor, slots: torch.Tensor | None) -> bool:
        """`tensor` summed over the groups, quorum_every's terms in its 2 elements `slots` where it has them
        (else launched after it: their round trip behind the later buckets'). False where the sum failed
        (recorded for `commit`: the step's vote goes against it, the sum is garbage)."""
        riding = slots is not None and self.flags_ride(tensor.dtype)
        if riding:
            slots.copy_(self.terms)
        self.next += 1  # (read once DDP's backward has waited for every bucket)
        work = self.direct.allreduce(tensor, ReduceOp.SUM)
        if self.next == 1 and not riding:
            self.send_terms()
        done = work.wait()
        if riding:
            self.terms.copy_(slots)
            self.terms_work = work
        return done

    def _sum_first(self, buffer: torch.Tensor, out: torch.futures.Future) -> None:
        """The backward's last bucket, a short one: x 1 / (group size x groups) summed over the groups whole
        (quorum_every's terms with it), then over the group with this process's commit vote terms (made up
        now that every sum over the groups is done): two of gloo's all-reduces where the ring took three
        exchanges driven from Python, each a few calls and wake-ups."""
        staged = self.staged = Staged.kept(self.staged, 1, buffer.numel(), buffer)
        try:
            torch.mul(buffer, self.factor / self.group_size, out=staged.first)
            done = self._over_groups(staged.flat, staged.terms)
            votes = None
            if self.vote_terms is not None:
                self.take_flags()
                votes = self.vote_terms()
                staged.terms.copy_(votes)  # (else what the sum over the groups left there, not read)
            dist.all_reduce(staged.flat, group=self.group)
        except Exception as err:  # the group's own exchange (a process of it died): DDP raises it
            out.set_exception(err)
            return
        if done and self.scale != 1.0:  # (a power of two: the scaled gradient DDP's `.grad` holds)
            staged.first.mul_(self.scale)
        buffer.copy_(staged.first)
        self.voted = staged.terms.clone() if votes is not None else None
        out.set_result(buffer)

    def _group_done(self, out: torch.futures.Future, index: int, fut: torch.futures.Future) -> None:
        buffer, error = None, None
        try:
            value = fut.value()  # a hook's tensor, or the all-reduce's list of one
            buffer = value[0] if isinstance(value, list) else value
        except Exception as err:  # the group's own reduction: DDP raises it from the backward
            error = err
        if buffer is not None:
            buffer.mul_(self.factor)
        with self.lock:  # launched in bucket order, whichever group all-reduce finishes first
            self.reduced[index] = (buffer, out, error)
            while self.next in self.reduced:
                bucket = self.reduced.pop(self.next)
                # counted before its sum can complete: DDP's backward returns once the last one has, and
                # `finish` then reads the count
                self.next += 1
                self._launch(*bucket)

    def _launch(self, buffer: torch.Tensor, out: torch.futures.Future, error: BaseException | None) -> None:
        if error is not None:
            out.set_exception(error)
            return
        work = self.direct.allreduce(buffer, ReduceOp.SUM)
        if self.next == 1:  # known since `arm`: its round trip behind the later buckets'
            self.send_terms()
        if work.work is None:  # not launched (the step is already discarded): the group's mean stays
            self._summed(buffer, out, None)
        else:
            work.work.get_future().add_done_callback(functools.partial(self._summed, buffer, out))

    def _summed(
        self, buffer: torch.Tensor, out: torch.futures.Future, fut: torch.futures.Future | None
    ) -> None:
        # the future's own result: gloo runs this callback before its work counts as finished, so the work's
        # `wait` would wait for this callback
        try:
            if fut is not None:
                fut.wait()
        except Exception as err:  # recorded for `commit` (the step is discarded), never raised
            self.direct.manager.report_error(err)
        if self.scale != 1.0:
            buffer.mul_(self.scale)  # a power of two: the scaled gradient DDP's `.grad` is expected to hold
        out.set_result(buffer)


def ddp_to_chain(trainer: Any) -> DistributedDataParallel | None:
    """The strategy's DDP wrapper when the sum over the groups may chain onto its comm hook: DDP over the whole
    replica group, no DTensor parameter, no pipeline, and no comm hook but the strategy's `ChainableHook`
    (DDP's reducer takes one hook, registered for good)."""
    strategy = trainer.strategy
    model = getattr(strategy, "model", None)
    if not isinstance(model, DistributedDataParallel) or getattr(strategy, "pipeline", None) is not None:
        return None
    foreign = [h for h, _ in model._comm_hooks if not isinstance(h, ChainableHook)]
    if model.process_group.size() != strategy.world_size or foreign:
        return None
    if any(hasattr(p, "to_local") for p in trainer.module.parameters()):
        return None
    return model
