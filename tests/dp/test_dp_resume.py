"""DP-SGD's random streams over epochs and resumes: each epoch draws new Poisson batches, and a run
stopped and resumed from its checkpoint draws the same batches and the same noise, step for step, as one
that ran straight through with the same `noise_seed`."""

from __future__ import annotations

import pytest
import torch
from dp_sgd_script import Classifier, Grads, fit, weights
from helpers import StopAt


class Recording(Classifier):
    """Appends the first feature of each sample of every batch it trains on to `seen`."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(batch[0][:, 0].tolist())


def run(root, max_steps, seen, callbacks=(), ckpt_path=None, noise_seed=11):
    """batch_size 24 of 96 examples: q = 1/4, so an epoch is 4 steps."""
    torch.manual_seed(1)
    module = Recording(seen)
    fit(root, 1, module, callbacks, max_steps, 24, True, ckpt_path, noise_seed=noise_seed)
    return module


def test_each_epoch_draws_new_poisson_batches(tmp_path):
    seen = []
    run(tmp_path, 8, seen)
    first, second = seen[:4], seen[4:]
    assert len(second) == 4
    assert first != second  # the same 4 samples again would train on every epoch's batches as the first's


@pytest.mark.parametrize("stop", [2, 5])  # within the first epoch, and within the second
def test_a_resumed_run_draws_the_batches_and_noise_of_a_straight_one(tmp_path, stop):
    straight_batches, straight_grads = [], Grads()
    straight = run(tmp_path / "straight", 7, straight_batches, [straight_grads])

    resumed_batches, resumed_grads = [], Grads()
    run(tmp_path / "resumed", 7, resumed_batches, [resumed_grads, StopAt(stop)])
    # no noise_seed given: the resumed run draws its streams from the checkpoint's seed, not a fresh secret
    resumed = run(tmp_path / "resumed", 7, resumed_batches, [resumed_grads], "last", noise_seed=None)

    assert resumed_batches == straight_batches
    assert len(resumed_grads.grads) == 7
    for step, (got, expected) in enumerate(zip(resumed_grads.grads, straight_grads.grads, strict=True), 1):
        assert torch.allclose(got, expected, atol=1e-6), f"step {step}: the noised gradient differs"
    assert weights(resumed) == pytest.approx(weights(straight), abs=1e-6)
