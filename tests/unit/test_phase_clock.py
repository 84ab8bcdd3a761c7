"""The phase clock keeps one span object per phase between uses: a phase opened inside itself still gets a
span of its own, so both spans count in full."""

from __future__ import annotations

import pytest

from trainer.core import timing


def test_a_phase_nested_in_itself_counts_both_spans_and_reused_spans_count_again(
    monkeypatch: pytest.MonkeyPatch,
):
    now = [0.0]
    monkeypatch.setattr(timing, "perf_counter", lambda: now[0])
    clock = timing.PhaseClock()
    clock.watch(monkeypatch)
    with clock.phase("forward"):
        now[0] += 1.0
        with clock.phase("forward"):
            now[0] += 2.0
        now[0] += 4.0
    with clock.phase("forward"):  # a span kept from before
        now[0] += 8.0
    assert clock.totals["forward"] == 7.0 + 2.0 + 8.0


def test_a_clock_nobody_watches_times_nothing_and_refuses_a_snapshot(monkeypatch: pytest.MonkeyPatch):
    now = [0.0]
    monkeypatch.setattr(timing, "perf_counter", lambda: now[0])
    clock, reader = timing.PhaseClock(), object()
    with clock.phase("data"):  # nobody reads the clock: no span, no cost
        now[0] += 1.0
    with pytest.raises(RuntimeError, match="call clock.watch"):
        clock.snapshot()
    clock.watch(reader)
    with clock.phase("data"):
        now[0] += 2.0
    assert clock.snapshot()["data"] == 2.0
    clock.unwatch(reader)
    with clock.phase("data"):
        now[0] += 4.0
    assert clock.totals["data"] == 2.0
