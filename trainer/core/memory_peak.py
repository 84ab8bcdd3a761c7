"""The peak of one process's tracked CPU allocations: every allocation and free of torch's CPU allocator
that the profiler records (`profile_memory=True`), summed in time order. What a rank holds at its peak,
counted from when the tracking starts (a run tracked from before its model is built counts all of it)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


class PeakBytes:
    """`peak`: the most bytes live at once inside `track()` of what was allocated inside it; `end`: of
    those, the bytes still live at its end."""

    def __init__(self) -> None:
        self.peak = self.end = 0

    @contextlib.contextmanager
    def track(self) -> Iterator[PeakBytes]:
        gc.collect()  # an earlier run's cycles freed now, not in the middle of this one
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield self
        events = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
            stack.extend(node.children)
        # frees of blocks allocated before the window (the profiler remembers earlier windows' sizes)
        # would count against this one: only blocks allocated inside it are counted
        live_ptrs: dict[int, int] = {}  # address -> size of the block that holds it now
        late_frees: dict[int, list[int]] = {}  # address -> sizes of blocks it held before, frees to come
        live = peak = 0
        for _, ptr, size in sorted(events):
            if size > 0:
                if ptr in live_ptrs:
                    # another thread freed this address and recorded it only after this allocation took it
                    # (gloo's and autograd's threads free tensors too): the old block went first, and its
                    # free, still to come, is not this block's
                    live -= live_ptrs[ptr]
                    late_frees.setdefault(ptr, []).append(live_ptrs[ptr])
                live_ptrs[ptr] = size
            elif -size in late_frees.get(ptr, ()):
                late_frees[ptr].remove(-size)
                continue
            elif ptr in live_ptrs:
                del live_ptrs[ptr]
            else:
                continue
            live += size
            peak = max(peak, live)
        self.peak, self.end = peak, live
