"""quorum_every's flags ride a sum of the gradients over the replica groups (group_average.py `flags_ride`) only
in a dtype that counts every group exactly: the groups' in-step flags sum to the participants, and a group out
of step must show (bf16 counts to 256, fp16 to 2048)."""

from __future__ import annotations

import pytest
import torch

from trainer.fault_tolerance.group_average import GroupAverage


class _Armed(GroupAverage):
    def _reset(self) -> None:
        """No per-step state of its own."""


def _armed(groups: int, terms: tuple[float, float] | None = (1.0, 0.0)) -> GroupAverage:
    average = _Armed([], direct=None, costs=None)
    average.arm(groups, terms=terms)
    return average


@pytest.mark.parametrize(
    ("groups", "dtype", "rides"),
    [
        (2, torch.bfloat16, True),
        (256, torch.bfloat16, True),
        (257, torch.bfloat16, False),
        (2048, torch.float16, True),
        (2049, torch.float16, False),
        (100_000, torch.float32, True),
    ],
)
def test_the_flags_ride_a_sum_whose_dtype_counts_every_group(groups, dtype, rides):
    assert _armed(groups).flags_ride(dtype) is rides
    # why: the sums of all groups in step and of one out of step, each held exactly (or not)
    exact = all(torch.tensor(float(n), dtype=dtype).item() == n for n in (groups - 1, groups))
    assert exact is rides


def test_no_flags_to_ride_without_quorum_every_or_once_sent():
    assert not _armed(2, terms=None).flags_ride(torch.float32)
    average = _armed(2)
    average.terms_work = object()  # sent already (riding an earlier sum, or on their own)
    assert not average.flags_ride(torch.float32)
