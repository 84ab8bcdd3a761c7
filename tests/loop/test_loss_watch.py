"""The first non-finite step is found over the folds of recorded losses (a list append per step, a few tensor
ops per FOLD_EVERY steps), whichever fold it falls in."""

from __future__ import annotations

import math

import pytest
import torch

from strategies import SingleDeviceStrategy
from trainer.loop.finiteness import FOLD_EVERY, LossWatch


def watch(bad_steps: set[int], steps: int) -> LossWatch:
    losses = LossWatch(SingleDeviceStrategy())
    for step in range(steps):
        losses.record(torch.tensor(math.nan if step in bad_steps else 1.0 / (step + 1)), step)
    return losses


@pytest.mark.parametrize(
    ("bad", "first"),
    [(set(), None), ({5}, 5), ({FOLD_EVERY + 3}, FOLD_EVERY + 3), ({FOLD_EVERY + 3, 7}, 7), ({0, 2}, 0)],
)
def test_the_first_non_finite_step_is_found_in_any_fold(bad, first):
    assert watch(bad, 2 * FOLD_EVERY + 5).first_not_finite() == first


def test_a_later_fold_never_moves_the_first_step_on():
    losses = watch({3}, FOLD_EVERY)  # folded: step 3
    for step in range(FOLD_EVERY, 2 * FOLD_EVERY):
        losses.record(torch.tensor(math.inf), step)
    assert losses.first_not_finite() == 3
    assert losses.last is not None and math.isinf(float(losses.last))


def test_one_element_losses_of_several_shapes_fold_alike():
    """A manual step's loss may be [1] or [1, 1] as well as 0-d: the fold takes them together."""
    losses = LossWatch(SingleDeviceStrategy())
    shapes = [(), (1,), (1, 1)]
    for step in range(FOLD_EVERY + 2):
        value = math.nan if step == FOLD_EVERY - 2 else 1.0
        losses.record(torch.full(shapes[step % 3], value), step)
    assert losses.first_not_finite() == FOLD_EVERY - 2
