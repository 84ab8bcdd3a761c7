"""Where a step's time goes: data, forward, backward, optimizer, timed per rank.

The loop and the strategy wrap each phase in `clock.phase(name)`. While something reads the clock (a
callback that called `watch`, such as straggler detection, which diffs two snapshots), that adds the
phase's wall-clock seconds to the running `totals`; while a torch profiler is recording, it labels the
span `trainer.<name>` in its trace. Otherwise a span does nothing: a step pays for no clock nobody reads.
On CUDA, host time is launch time; a watcher that needs device time calls `request_sync` for the steps it
measures.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

from torch.autograd import _profiler_enabled
from torch.autograd.profiler import record_function

PHASES = ("data", "forward", "backward", "optimizer")


class PhaseClock:
    """Running seconds per phase while watched; one instance per strategy."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.synchronize: Callable[[], None] | None = None  # called at phase boundaries while requested
        self._sync_requests: dict[int, Callable[[], None]] = {}
        self._watchers: set[int] = set()
        self._idle: dict[str, _Phase] = {}  # a span object per phase, kept between uses (several a step)

    def phase(self, name: str) -> _Phase | _NoSpan:
        if not self._watchers and not _profiler_enabled():
            return NO_SPAN
        span = self._idle.pop(name, None)  # None while that phase's span is open (a nested one): a new one
        return _Phase(self, name) if span is None else span

    def watch(self, watcher: object) -> None:
        """Time the phases from now on for `watcher`, until it calls `unwatch`; `snapshot` needs one."""
        self._watchers.add(id(watcher))

    def unwatch(self, watcher: object) -> None:
        self._watchers.discard(id(watcher))
        self.release_sync(watcher)

    def request_sync(self, watcher: object, synchronize: Callable[[], None]) -> None:
        """Synchronize the device (e.g. `torch.cuda.synchronize`) at phase boundaries until released, so
        spans measure device time; several watchers may ask at once."""
        self._sync_requests[id(watcher)] = synchronize
        self.synchronize = synchronize

    def release_sync(self, watcher: object) -> None:
        self._sync_requests.pop(id(watcher), None)
        self.synchronize = next(iter(self._sync_requests.values()), None)

    def snapshot(self) -> dict[str, float]:
        """A copy of the running totals; subtract an earlier snapshot to time a window of steps."""
        if not self._watchers:  # the totals would not move: a reader that forgot `watch` would read zeros
            raise RuntimeError("PhaseClock.snapshot() while nobody watches; call clock.watch(reader) first")
        return dict(self.totals)


class _Phase:
    """Context manager for one span of a phase (a class, not a generator: it runs several times a step)."""

    __slots__ = ("clock", "name", "start", "label")

    def __init__(self, clock: PhaseClock, name: str) -> None:
        self.clock, self.name, self.label = clock, name, None

    def __enter__(self) -> None:
        clock = self.clock
        if clock.synchronize is not None:
            clock.synchronize()
        if _profiler_enabled():
            self.label = record_function(f"trainer.{self.name}")
            self.label.__enter__()
        self.start = perf_counter()

    def __exit__(self, *exc: Any) -> None:
        clock = self.clock
        if clock.synchronize is not None:
            clock.synchronize()
        clock.totals[self.name] += perf_counter() - self.start
        if self.label is not None:
            self.label.__exit__(*exc)
            self.label = None
        clock._idle[self.name] = self


class _NoSpan:
    """The span of a phase nobody times."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


NO_SPAN = _NoSpan()
