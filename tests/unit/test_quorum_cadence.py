"""The quorum cadence of `FaultTolerance(quorum_every=k)` (trainer/fault_tolerance/cadence.py): which steps ask
for a quorum, and what the flags summed with the gradients decide. The groups' side under kills and skips:
tests/distributed/test_fault_tolerance.py (quorum_every 4 and 8)."""

from __future__ import annotations

from trainer.fault_tolerance.cadence import QuorumCadence


def walk(
    cadence: QuorumCadence, steps: range, flags: dict[int, float], commits: dict[int, bool]
) -> list[int]:
    """The steps that ask for a quorum, with 2 groups: `flags` (default 2.0) the step's flag sum, `commits`
    (default True) this group's commit vote result."""
    asked = []
    for step in steps:
        if cadence.due(step):
            asked.append(step)
            cadence.asked()
        agreed = cadence.agreed(flags.get(step, 2.0), 2)
        cadence.committed(commits.get(step, True) and agreed, failed=False)
    return asked


def test_the_first_step_and_every_kth_ask_for_a_quorum():
    assert walk(QuorumCadence(4), range(1, 14), {}, {}) == [1, 4, 8, 12]


def test_a_step_this_group_did_not_apply_lowers_its_flag_and_the_next_quorum_comes_a_step_later():
    cadence = QuorumCadence(8)
    assert walk(cadence, range(0, 3), {}, {2: False}) == [0]
    assert cadence.flag() == 0.0  # step 3's flag: out of step
    # step 3 sums 1.0 (the peer's) with 2 participants: every group discards it, and step 4 asks
    assert walk(cadence, range(3, 10), {3: 1.0}, {}) == [4, 8]
    assert cadence.flag() == 1.0


def test_a_failed_collective_asks_for_a_quorum_at_the_next_step():
    cadence = QuorumCadence(8)
    walk(cadence, range(0, 2), {}, {})
    cadence.committed(False, failed=True)  # step 2: a peer died in the all-reduce
    assert cadence.due(3)
