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
        live_ptrs: set[int] = set()
        live = peak = 0
        for _, ptr, size in sorted(events):
            if size > 0:
                live_ptrs.add(ptr)
            elif ptr in live_ptrs:
                live_ptrs.discard(ptr)
            else:
                continue
            live += size
            peak = max(peak, live)
        self.peak, self.end = peak, live
