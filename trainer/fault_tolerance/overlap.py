"""The cross-group gradient average overlapped with the backward, as DDP overlaps its own: the gradients in
~25 MB buckets in reverse parameter order, each bucket's `manager.allreduce` launched as soon as its last
gradient is accumulated, all of them waited for before the commit."""

from __future__ import annotations

from time import perf_counter
from typing import Any

import torch
from torch import nn

from trainer.fault_tolerance.costs import StepCosts

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


class _Bucket:
    """Consecutive parameters (one dtype and device) reduced together through one flat buffer."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        first = params[0]
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        self.views = [
            piece.view_as(p)
            for piece, p in zip(self.flat.split([p.numel() for p in params]), params, strict=True)
        ]
        self.ready: set[int] = set()  # indexes into params whose gradient is in `flat`
        self.work: Any = None  # the launched all-reduce

    def reset(self) -> None:
        self.ready.clear()
        self.work = None


class OverlappedAverage:
    """Post-accumulate-grad hooks on `module`'s parameters that all-reduce each bucket over the replica groups
    while the rest of the backward runs. Buckets launch strictly in order (bucket 0 first), so every group
    makes the same sequence of collectives whatever the order its hooks fire in; a parameter without a
    gradient this step holds its bucket (and those after it) back to `finish`. Only while `arm`ed: one
    backward per step (a second hook call for a parameter marks the step stale, see `finish`)."""

    def __init__(
        self,
        module: nn.Module,
        manager: Any,
        bucket_bytes: int = BUCKET_BYTES,
        costs: StepCosts | None = None,
    ) -> None:
        self.manager, self.costs = manager, costs or StepCosts()  # the replica group's, to share its totals
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):  # the backward produces the last layers' gradients first
            if current and (
                size + p.numel() * p.element_size() > bucket_bytes
                or (p.dtype, p.device) != (current[0].dtype, current[0].device)
            ):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self.buckets.append(_Bucket(current))
        self.where = {
            id(p): (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)
        }
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]
        self.armed = False
        self.stale = (
            False  # a parameter's gradient changed after its bucket was copied: redo after the backward
        )
        self.next = 0  # the next bucket to launch

    def arm(self) -> None:
        """The next backward is the step's only one: launch its buckets as their gradients are ready."""
        for bucket in self.buckets:
            bucket.reset()
        self.armed, self.stale, self.next = True, False, 0

    def finish(self, use: bool) -> bool:
        """After the backward: launch what did not launch (a parameter without a gradient this step counts as
        zeros and keeps no gradient) and wait for every bucket; with `use`, the averages become `.grad` (views
        of the buckets, which the next step's backward refills).
        False when they were not written: not `use`, or a second backward changed a gradient after it was
        copied (every group sees the same, and the caller averages again after the backward)."""
        if not self.armed:
            return False
        self.armed = False
        for bucket in self.buckets[self.next :]:
            self._launch(bucket)
        self.next = len(self.buckets)
        start = perf_counter()
        for bucket in self.buckets:
            bucket.work.wait()  # a failure is recorded by torchft (the step is then discarded), never raised
        start = self.costs.add("allreduce", start)
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
        if i in bucket.ready or bucket.work is not None:
            self.stale = True  # a second backward this step: what was copied is out of date
            return
        start = perf_counter()
        bucket.views[i].copy_(p.grad)
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
            if i not in bucket.ready:  # no gradient this step (unused, or its hook has not run): a zero
                if p.grad is None:
                    bucket.views[i].zero_()
                else:
                    bucket.views[i].copy_(p.grad)
        start = self.costs.add("copies", start)
        bucket.work = self.manager.allreduce(bucket.flat)
        self.costs.add("allreduce", start)
