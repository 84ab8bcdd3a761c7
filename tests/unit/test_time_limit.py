"""max_time without a collective per step (trainer/loop/time_limit.py): one process reads its clock every step;
several agree on the slowest clock only at steps the agreements themselves schedule."""

from __future__ import annotations

from trainer.loop.time_limit import MAX_INTERVAL, TimeLimit


def run(limit: TimeLimit, seconds_per_step: float, steps: int, slowest_factor: float = 1.0):
    """Steps 0.. until the limit is reached (or `steps`): (the stop step, the steps that agreed). This
    rank's clock moves `seconds_per_step`; the slowest rank's `slowest_factor` times as fast."""
    agreed: list[int] = []
    for step in range(steps + 1):

        def slowest(elapsed: float, step: int = step) -> float:
            agreed.append(step)
            return elapsed * slowest_factor

        if limit.reached(step, step * seconds_per_step, slowest):
            return step, agreed
    return None, agreed


def test_one_process_reads_its_clock_every_step_and_never_agrees():
    assert run(TimeLimit(5.0, 0, agreed=False), 2.0, 10) == (3, [])


def test_the_ranks_agree_as_half_the_time_left_passes_and_stop_where_a_check_every_step_would():
    # 6 s per step, 50 s: agreements after steps 1 (44 s left: next in 3), 4 (26 s: 2), 6 (14 s: 1), 7, 8, 9
    assert run(TimeLimit(50.0, 0, agreed=True), 6.0, 20) == (9, [1, 4, 6, 7, 8, 9])


def test_the_slowest_clock_decides_for_every_rank():
    stop, _ = run(TimeLimit(50.0, 0, agreed=True), 3.0, 40, slowest_factor=2.0)
    assert stop == 9  # this rank's own clock (27 s) is not up; the slowest's (54 s) is


def test_a_long_limit_agrees_at_least_every_max_interval_steps():
    stop, agreed = run(TimeLimit(3600.0, 10, agreed=True), 0.01, 10 + 3 * MAX_INTERVAL)
    assert stop is None and agreed == [11, 11 + MAX_INTERVAL, 11 + 2 * MAX_INTERVAL]
