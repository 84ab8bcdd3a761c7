"""The quorum cadence of `FaultTolerance(quorum_every=k)` (trainer/fault_tolerance/cadence.py): which steps ask
for a quorum, and what the terms summed with the gradients (in step; wishing for a quorum) decide. The groups' side under kills and skips:
tests/distributed/test_fault_tolerance.py (quorum_every 4 and 8)."""

from __future__ import annotations

from trainer.fault_tolerance.cadence import QuorumCadence


def walk(
    cadence: QuorumCadence,
    steps: range,
    flags: dict[int, float],
    commits: dict[int, bool],
    wishes: dict[int, float] | None = None,
) -> list[int]:
    """The steps that ask for a quorum, with 2 groups: `flags` (default 2.0) the step's in-step sum, `wishes`
    (default: this group's own wish) the sum of wishes for a quorum, `commits` (default True) this group's
    commit vote result."""
    asked = []
    for step in steps:
        if cadence.due(step):
            asked.append(step)
            cadence.asked()
        wish = (wishes or {}).get(step, cadence.terms()[1])
        agreed = cadence.agreed((flags.get(step, 2.0), wish), 2)
        cadence.committed(commits.get(step, True) and agreed, failed=False)
    return asked


def test_the_first_step_and_every_kth_ask_for_a_quorum():
    assert walk(QuorumCadence(4, 10.0), range(1, 14), {}, {}) == [1, 4, 8, 12]


def test_a_step_this_group_did_not_apply_lowers_its_flag_and_the_next_quorum_comes_a_step_later():
    cadence = QuorumCadence(8, 10.0)
    assert walk(cadence, range(0, 3), {}, {2: False}) == [0]
    assert cadence.terms()[0] == 0.0  # step 3's flag: out of step
    # step 3 sums 1.0 (the peer's) with 2 participants: every group discards it, and step 4 asks
    assert walk(cadence, range(3, 10), {3: 1.0}, {}) == [4, 8]
    assert cadence.terms()[0] == 1.0


def test_a_failed_collective_asks_for_a_quorum_at_the_next_step():
    cadence = QuorumCadence(8, 10.0)
    walk(cadence, range(0, 2), {}, {})
    cadence.committed(False, failed=True)  # step 2: a peer died in the all-reduce
    assert cadence.due(3)


class Clock:
    """A clock the test moves: `seconds` a step."""

    def __init__(self, seconds: float) -> None:
        self.now, self.seconds = 0.0, seconds

    def __call__(self) -> float:
        return self.now


def test_where_k_steps_take_longer_than_max_interval_the_group_wishes_for_a_quorum_and_all_ask_next():
    clock = Clock(3.0)
    cadence = QuorumCadence(100, 10.0, clock)
    asked = []
    for step in range(0, 12):  # 3 s steps: the quorum of step 0 is 10 s old at step 4's start
        if cadence.due(step):
            asked.append(step)
            cadence.asked()
        cadence.agreed((2.0, cadence.terms()[1]), 2)
        cadence.committed(True, failed=False)
        clock.now += clock.seconds
    assert asked == [0, 5, 10]  # the wish goes with step 4's sums, 9's: the quorums at 5 and 10


def test_a_peers_wish_asks_for_a_quorum_at_the_next_step_as_well():
    # this group's own clock has no wish (0 s pass), its peer's sums carry one at step 3
    cadence = QuorumCadence(8, 10.0, Clock(0.0))
    assert walk(cadence, range(0, 6), {}, {}, {3: 1.0}) == [0, 4]
    # a step that a group did not apply still comes first: the wish does not hide it
    assert walk(cadence, range(6, 9), {6: 1.0}, {}, {6: 1.0}) == [7, 8]
