"""wsd when `decay_fraction` x T is not a whole number of steps: the decay window is round(fraction x T)
steps, the last ones of the run (torchtitan's WSD rounds the same way), and the lr at its boundaries is
pinned here against a hand computation."""

from __future__ import annotations

import pytest
from test_schedules import lrs

from trainer.core.schedules import LRSchedule


@pytest.mark.parametrize(
    "fraction, expected",
    [
        # 0.27 x 10 = 2.7 -> a 3-step window: stable through step 7, then 1 - 0.9 x (s - 7) / 3
        (0.27, [1.0] * 8 + [1 - 0.9 / 3, 1 - 0.9 * 2 / 3, 0.1]),
        # 0.23 x 10 = 2.3 -> a 2-step window: stable through step 8, then 1 - 0.9 x (s - 8) / 2
        (0.23, [1.0] * 9 + [1 - 0.9 / 2, 0.1]),
    ],
)
def test_wsd_decays_over_the_rounded_last_fraction(fraction, expected):
    schedule = LRSchedule("wsd", warmup_steps=0, total_steps=10, min_lr_ratio=0.1, decay_fraction=fraction)
    assert lrs(schedule, 11) == pytest.approx(expected)


def test_wsd_with_warmup_and_a_fractional_window():
    """W = 2, T = 9, 0.3 x 9 = 2.7 -> 3 decay steps from step 6; warmup (s + 1) / 2."""
    schedule = LRSchedule("wsd", warmup_steps=2, total_steps=9, min_lr_ratio=0.0, decay_fraction=0.3)
    assert lrs(schedule, 10) == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2 / 3, 1 / 3, 0.0])
