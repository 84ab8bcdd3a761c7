"""The step a replica group gives torchft's quorum, which heals every group below the highest from one at
it: a group resumed from a checkpoint saved just before a step its peers then discarded (a peer of theirs
died in it) has applied as many updates as they have, yet is a step behind. Ranked by updates alone the two
met as equals, no one healed, and the resumed group ran one step behind for good: its learning rate, data
and checkpoint names a step off its peers' (seen in `trainer replicas`' launcher test, whose groups then
held at different steps and the job hung)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft")


def test_a_group_a_step_behind_with_as_many_updates_ranks_below_its_peers():
    from trainer.fault_tolerance.replica_group import quorum_step

    survivor = quorum_step(11, 9)  # steps 0-10, two of them discarded
    resumed = quorum_step(10, 9)  # from its checkpoint at step 10, one step of its own discarded before
    assert resumed < survivor


def test_a_group_that_discarded_a_step_its_peers_committed_ranks_below_them():
    from trainer.fault_tolerance.replica_group import quorum_step

    assert quorum_step(10, 9) < quorum_step(10, 10)
    assert quorum_step(10, 10) == quorum_step(10, 10)  # in step: no one heals


def test_the_loop_step_outranks_the_updates():
    from trainer.fault_tolerance.replica_group import quorum_step

    # the group that saw more of the run is the source, whatever it discarded on the way
    assert quorum_step(11, 5) > quorum_step(10, 10)
    assert quorum_step(10**9 - 1, 10**9 - 1) < 2**63  # torchft's step is a signed 64-bit integer


def test_torchfts_logs_read_the_step_then_the_updates():
    from trainer.fault_tolerance.replica_group import quorum_step

    assert str(quorum_step(11, 9)) == "11" + "000000009"
