"""The cross-group gradient average overlapped with the backward, as DDP overlaps its own: the gradients in
buckets in reverse parameter order, sized as DDP sizes them (a ~1 MB first bucket, then ~25 MB ones), each
bucket's `manager.allreduce` launched as soon as its last gradient of the step is accumulated (with gradient
accumulation: in the window's last backward), all of them waited for before the commit. A gradient is
divided by the number of groups as it is copied into its bucket and the buckets are summed: one pass over
the gradients, where torchft's average adds a division after the reduce."""

from __future__ import annotations

from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp

from trainer.fault_tolerance.costs import StepCosts

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
# DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES): the last layers' gradients, ready first, go out while
# the rest of the backward runs; a first bucket of the full size would wait for most of the backward
FIRST_BUCKET_BYTES = 1024 * 1024


class _Bucket:
    """Consecutive parameters (one dtype and device) reduced together through one flat buffer."""

    def __init__(self, params: list[nn.Parameter], spare: int = 0) -> None:
        self.params = params
        first = params[0]
        # `spare` elements after the gradients': a value summed over the groups with them (the flag)
        size = sum(p.numel() for p in params) + spare
        self.flat = torch.zeros(size, dtype=first.dtype, device=first.device)
        self.views = [
            piece.view_as(p)
            for piece, p in zip(
                self.flat.split([p.numel() for p in params] + [spare])[: len(params)], params, strict=True
            )
        ]
        self.ready: set[int] = set()  # indexes into params whose gradient is in `flat`
        self.seen = [0] * len(params)  # backwards this step that accumulated each parameter's gradient
        self.work: Any = None  # the launched all-reduce

    def reset(self) -> None:
        self.ready.clear()
        self.seen = [0] * len(self.params)
        self.work = None


class OverlappedAverage:
    """Post-accumulate-grad hooks on `module`'s parameters that all-reduce each bucket over the replica groups
    while the rest of the backward runs. Buckets launch strictly in order (bucket 0 first), so every group
    makes the same sequence of collectives whatever the order its hooks fire in; a parameter without a
    gradient in the step's last backward holds its bucket (and those after it) back to `finish`. Only while
    `arm`ed for a number of backwards: a parameter's gradient is final (copied) at its hook's call in the
    last of them; one more call marks the step stale (see `finish`)."""

    layout_after_first_backward = False  # its buckets: the parameters' order, fixed at construction

    def __init__(
        self,
        module: nn.Module,
        manager: Any,
        bucket_bytes: int = BUCKET_BYTES,
        costs: StepCosts | None = None,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        flag: bool = False,
    ) -> None:
        self.manager, self.costs = manager, costs or StepCosts()  # the replica group's, to share its totals
        params = [p for p in module.parameters() if p.requires_grad]
        self.elements = sum(p.numel() for p in params)  # the gradients' elements, every bucket's
        groups = _bucketed(params, first_bucket_bytes, bucket_bytes)
        # `flag`: the last bucket carries two more elements, each group's terms (`arm`), summed (`flags`)
        self.buckets = [_Bucket(group, 2 * (flag and i == len(groups) - 1)) for i, group in enumerate(groups)]
        self.carries_flag, self.flags = flag, (0.0, 0.0)
        self.where = {
            id(p): (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)
        }
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]
        self.armed = False
        self.backwards = 1  # the step's backwards (its micro-batches): a gradient is final in the last one
        self.factor = 1.0  # a gradient's factor as the hooks copy it: 1 / groups (x 1 / fp16's loss scale)
        self.groups = 1  # the step's participating groups
        self.undo = 1.0  # see `finish`
        self.stale = (
            False  # a parameter's gradient changed after its bucket was copied: redo after the backward
        )
        self.next = 0  # the next bucket to launch

    def arm(
        self, groups: int, backwards: int = 1, inv_scale: float = 1.0, terms: tuple[float, float] = (0.0, 0.0)
    ) -> None:
        """The step's average is over `groups` groups and it takes `backwards` backwards (one per
        micro-batch): launch its buckets as their gradients are final, in the last one. A step of fewer (an
        epoch's short last window) launches them in `finish`. `inv_scale` (fp16's 1 / loss scale): the
        gradients are copied unscaled, as the scaler's `unscale_` would (a power of two: the same bits), so
        groups whose scales differ average true gradients. `terms` (built with `flag=True`): this group's terms
        of the step's two flag sums (quorum_every's, cadence.py), read after `finish` as `flags`."""
        for bucket in self.buckets:
            bucket.reset()
        if self.carries_flag:
            self.buckets[-1].flat[-2], self.buckets[-1].flat[-1] = terms
        self.armed, self.stale, self.next, self.backwards = True, False, 0, backwards
        self.groups, self.factor = groups, inv_scale / groups

    def finish(self, use: bool, undo: float = 1.0, extra: torch.Tensor | None = None) -> bool:
        """After the backward: launch what did not launch (a parameter without a gradient this step counts as
        zeros and keeps no gradient; one whose gradient the hooks did not copy is copied x `undo`, what
        undoes the loop's normalization since the backward: its token count) and wait for every bucket;
        with `use`, the averages become `.grad` (views of the buckets, which the next step's backward
        refills). `extra` (the step's token count) is summed over the groups in place, launched after the
        last bucket and before the waits: its round trip overlaps theirs.
        False when they were not written: not `use`, or a backward more than armed for changed a gradient
        after it was copied (every group sees the same, and the caller averages again after the backward)."""
        if not self.armed:
            return False
        self.armed, self.undo = False, undo
        for bucket in self.buckets[self.next :]:
            self._launch(bucket)
        self.next = len(self.buckets)
        start = perf_counter()
        summed = self.manager.allreduce(extra, reduce_op=ReduceOp.SUM) if extra is not None else None
        for bucket in self.buckets:
            bucket.work.wait()  # a failure is recorded by torchft (the step is then discarded), never raised
        if summed is not None:
            summed.wait()
        start = self.costs.add("allreduce", start)
        if self.carries_flag:
            self.flags = tuple(self.buckets[-1].flat[-2:].tolist())
        if not use or self.stale:
            return False
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if p.grad is not None and p.grad.dtype == view.dtype:
                    p.grad = view  # as DDP's gradient_as_bucket_view (the Trainer's default): no copy back
                elif p.grad is not None:
                    p.grad.copy_(view)
        self.costs.add("copies", start)
        return True

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for handle in self.handles:
            handle.remove()
        self.armed = False

    def _ready(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        b, i = self.where[id(p)]
        bucket = self.buckets[b]
        bucket.seen[i] += 1
        if i in bucket.ready or bucket.work is not None:
            self.stale = True  # one backward more than armed for: what was copied is out of date
            return
        if bucket.seen[i] < self.backwards:
            return  # an earlier micro-batch's: the gradient is not final yet
        start = perf_counter()
        torch.mul(p.grad, self.factor, out=bucket.views[i])
        self.costs.add("copies", start)
        bucket.ready.add(i)
        while self.next < len(self.buckets) and len(self.buckets[self.next].ready) == len(
            self.buckets[self.next].params
        ):
            self._launch(self.buckets[self.next])
            self.next += 1

    def _launch(self, bucket: _Bucket) -> None:
        start = perf_counter()
        for i, p in enumerate(bucket.params):
            if i not in bucket.ready:  # no gradient in the step's last backward (or its hook has not run)
                if p.grad is None:
                    bucket.views[i].zero_()
                else:  # one from an earlier micro-batch (a short window: every one), normalized since
                    torch.mul(p.grad, self.undo / self.groups, out=bucket.views[i])
        start = self.costs.add("copies", start)
        bucket.work = self.manager.allreduce(bucket.flat, reduce_op=ReduceOp.SUM)
        self.costs.add("allreduce", start)


def _bucketed(params: list[nn.Parameter], first_bytes: int, bytes_: int) -> list[list[nn.Parameter]]:
    """`params` in buckets as DDP makes them (its rebuilt buckets, in the order the backward produces the
    gradients, taken here as the reverse of the parameters' order): one dtype and device per bucket, a bucket
    closed once it holds `first_bytes` (the first) or `bytes_` (the others)."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):  # the backward produces the last layers' gradients first
        if current and (p.dtype, p.device) != (current[0].dtype, current[0].device):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= (bytes_ if buckets else first_bytes):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
