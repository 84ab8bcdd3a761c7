"""NaNGuard: non-finite and spiking steps are skipped; K bad steps in a row roll back to a good checkpoint."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import Regression, fit, read_metrics, regression_loader

from callbacks import Callback, ModelCheckpoint, NaNGuard


class Poison(Callback):
    """Turns one parameter's gradient (or the loss the guard sees) into NaN/inf in chosen steps, and
    records the parameters around each step."""

    def __init__(self, steps, what="grad", value=float("nan")):
        self.steps, self.what, self.value = set(steps), what, value
        self.before, self.after = {}, {}

    def on_train_batch_start(self, trainer, module, batch_idx):
        self.before[trainer.global_step + 1] = [p.detach().clone() for p in module.parameters()]

    def on_after_backward(self, trainer, module):
        if trainer.global_step + 1 in self.steps:
            self.steps.discard(trainer.global_step + 1)  # once: after a rollback the data is different
            if self.what == "grad":
                next(module.parameters()).grad.fill_(self.value)
            else:
                trainer.step_loss = trainer.step_loss * self.value

    def on_train_batch_end(self, trainer, module, outputs):
        self.after[trainer.global_step] = [p.detach().clone() for p in module.parameters()]


def run(tmp_path, steps, callbacks, **kwargs):
    torch.manual_seed(0)  # the same initial weights in every run of a test
    module = Regression()
    return module, fit(
        module, regression_loader(shuffle=True), tmp_path, steps, callbacks=callbacks, **kwargs
    )


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "what, value", [("grad", float("nan")), ("grad", float("inf")), ("loss", float("nan"))]
)
def test_a_non_finite_step_is_skipped_and_logged(tmp_path, caplog, what, value):
    poison = Poison([3], what, value)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        module, trainer = run(tmp_path, 6, [poison, NaNGuard()])
    assert same(poison.after[3], poison.before[3])  # the parameters after step 3 are those before it
    assert not same(poison.after[4], poison.before[4])  # and training goes on
    assert all(torch.isfinite(p).all() for p in module.parameters())
    expected = "loss is not finite on 1 rank(s)" if what == "loss" else "gradient norm is"
    assert any(
        f"NaNGuard: step 3: {expected}" in r.message and "update skipped" in r.message for r in caplog.records
    )
    assert read_metrics(tmp_path, "nan_guard/skipped_steps") == {2: 1}
    assert read_metrics(tmp_path, "train/skipped_steps")[6] == 1 and trainer.state.skipped_steps == 1


def test_without_the_guard_a_nan_gradient_ruins_the_parameters(tmp_path):
    module, _ = run(tmp_path, 4, [Poison([3])])
    assert not all(torch.isfinite(p).all() for p in module.parameters())


def test_a_loss_spike_is_skipped(tmp_path, caplog):
    poison = Poison([8], "loss", 50.0)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        run(tmp_path, 10, [poison, NaNGuard(spike_factor=5.0, window=5, min_history=3)])
    assert same(poison.after[8], poison.before[8])
    assert sum("spiked above 5.0 x the running median" in r.message for r in caplog.records) == 1


def test_a_spike_only_warns_when_told_not_to_skip(tmp_path, caplog):
    poison = Poison([8], "loss", 50.0)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        run(tmp_path, 10, [poison, NaNGuard(spike_factor=5.0, window=5, min_history=3, skip_spikes=False)])
    assert not same(poison.after[8], poison.before[8])
    assert any("spiked above" in r.message for r in caplog.records)


class Steps(Callback):
    def __init__(self):
        self.taken = 0

    def on_train_batch_end(self, trainer, module, outputs):
        self.taken += 1


def test_bad_steps_in_a_row_roll_back_to_the_checkpoint_before_them(tmp_path, caplog):
    poison, counter = Poison([5, 6]), Steps()
    guard = NaNGuard(rollback_after=2)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        module, trainer = run(
            tmp_path, 8, [poison, ModelCheckpoint(every_n_steps=2, save_top_k=-1), guard, counter]
        )
    assert any("rolled back to step-00000004" in r.message for r in caplog.records)
    assert counter.taken == 6 + 4  # steps 1-6, then 5-8 again on the data that follows
    assert trainer.global_step == 8 and trainer.state.restarts == 1 and guard.rollbacks == 1
    # the checkpoint written during the bad streak belonged to the abandoned trajectory
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "discarded-step-00000006" in names and "step-00000006" in names and "step-00000008" in names
    # after the rollback the run reads the batches that follow step 6, not those of steps 5 and 6 again
    assert trainer.state.batches_in_epoch == 10


def test_the_guard_gives_up_when_rollbacks_do_not_help(tmp_path):
    always = Poison(range(3, 100))
    always.steps = type(
        "Every", (), {"__contains__": lambda self, k: k >= 3, "discard": lambda self, k: None}
    )()
    with pytest.raises(RuntimeError, match="NaNGuard: 2 rollbacks did not help"):
        run(
            tmp_path,
            20,
            [always, NaNGuard(rollback_after=2, max_rollbacks=2), ModelCheckpoint(every_n_steps=2)],
        )


def test_rollback_without_a_good_checkpoint_says_so(tmp_path):
    with pytest.raises(Exception, match="rollback needs a good checkpoint before step 2; there is none in"):
        run(tmp_path, 4, [Poison([2, 3]), NaNGuard(rollback_after=2)], enable_checkpointing=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rollback_after": 0}, "rollback_after=0 is invalid; allowed: an int >= 1 or None"),
        ({"spike_factor": 1.0}, "spike_factor=1.0 is invalid; allowed: a number > 1 or None"),
        ({"window": 0}, "window=0 is invalid; allowed: an int >= 1"),
        ({"max_rollbacks": -1}, "max_rollbacks=-1 is invalid; allowed: an int >= 0"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NaNGuard(**kwargs)
