"""NaNGuard: non-finite and spiking steps are skipped; K bad steps in a row roll back to a good checkpoint."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import Regression, ScriptedLoss, StopAt, fit, quiet, read_metrics, regression_loader

from callbacks import Callback, ModelCheckpoint, NaNGuard
from callbacks.checkpoint import ModelNotFiniteError
from strategies import SingleDeviceStrategy
from trainer import Trainer


class Poison(Callback):
    """Turns one parameter's gradient (or the loss the guard sees) into NaN/inf in chosen steps, and
    records the parameters around each step."""

    def __init__(self, steps, what="grad", value=float("nan")):
        self.steps, self.what, self.value = set(steps), what, value
        self.before, self.after = {}, {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before[trainer.global_step + 1] = [p.detach().clone() for p in module.parameters()]

    def on_after_backward(self, trainer, module):
        if trainer.global_step + 1 in self.steps:
            self.steps.discard(trainer.global_step + 1)  # once: after a rollback the data is different
            if self.what == "grad":
                next(module.parameters()).grad.fill_(self.value)
            else:
                trainer.step_loss = trainer.step_loss * self.value

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
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


def test_without_the_guard_a_nan_gradient_ruins_the_parameters_and_the_fit_fails_saying_since_when(tmp_path):
    poison = Poison([3])
    with pytest.raises(ModelNotFiniteError) as err:  # it used to end "fine", exit code 0
        run(tmp_path, 4, [poison])
    assert (
        str(err.value)
        == "the model is not finite since step 3; last good checkpoint: none (no good checkpoint)"
    )
    assert not all(torch.isfinite(p).all() for p in poison.after[4])


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
    warned = [r.message for r in caplog.records if "spiked above" in r.message]
    assert len(warned) == 1 and warned[0].startswith("NaNGuard: step 8: loss "), warned
    assert "update skipped" not in warned[0]


class Steps(Callback):
    def __init__(self):
        self.taken = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
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
    # the rollback is logged at the step the run went back to
    assert read_metrics(tmp_path, "nan_guard/rollbacks") == {4: 1}


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
        ({"min_history": 0}, "min_history=0 is invalid; allowed: an int >= 1"),
        ({"max_rollbacks": -1}, "max_rollbacks=-1 is invalid; allowed: an int >= 0"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NaNGuard(**kwargs)


def rollback_messages(caplog):
    return [r.message for r in caplog.records if "rolled back" in r.message]


@pytest.mark.parametrize("bad_steps", [4, 5])
def test_by_default_the_fifth_bad_step_in_a_row_rolls_back(tmp_path, caplog, bad_steps):
    poison = Poison(range(3, 3 + bad_steps))
    with caplog.at_level(logging.WARNING, logger="trainer"):
        _, trainer = run(tmp_path, 10, [poison, ModelCheckpoint(every_n_steps=2, save_top_k=-1), NaNGuard()])
    if bad_steps == 4:  # steps 3-6 skipped, step 7 good: no rollback
        assert rollback_messages(caplog) == [] and trainer.state.restarts == 0
    else:  # steps 3-7 skipped: back to step 2, the newest checkpoint before the first bad step
        assert rollback_messages(caplog) == [
            "NaNGuard: 5 bad steps in a row at step 7: rolled back to step-00000002; training goes on "
            "with the data that follows (the batches in between are skipped)"
        ]
        assert trainer.state.restarts == 1
    assert trainer.global_step == 10


def test_a_bad_first_step_is_skipped_and_counted_as_the_first_of_a_streak(tmp_path, caplog):
    poison = Poison([1])
    with caplog.at_level(logging.WARNING, logger="trainer"):
        module, trainer = run(tmp_path, 4, [poison, NaNGuard(rollback_after=2)])
    assert same(poison.after[1], poison.before[1]) and not same(poison.after[2], poison.before[2])
    assert [r.message for r in caplog.records if r.message.startswith("NaNGuard")] == [
        "NaNGuard: step 1: gradient norm is not finite on 1 rank(s); update skipped (1 bad step(s) in a row)"
    ]
    assert trainer.state.restarts == 0 and trainer.state.skipped_steps == 1


def test_a_loss_exactly_at_the_spike_threshold_is_not_a_spike(tmp_path, caplog):
    # median 1.0 over the good steps, factor 2: 2.0 is at the threshold (kept), 2.5 above it (skipped)
    module = ScriptedLoss([1.0, 1.0, 1.0, 2.0, 2.5, 1.0])
    guard = NaNGuard(spike_factor=2.0, window=5, min_history=3)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer = fit(module, regression_loader(), tmp_path, 6, callbacks=[guard])
    assert [r.message for r in caplog.records if "spiked" in r.message] == [
        "NaNGuard: step 5: loss 2.5 spiked above 2.0 x the running median 1; update skipped "
        "(1 bad step(s) in a row)"
    ]
    assert trainer.state.skipped_steps == 1


def test_a_resumed_run_keeps_the_loss_history_for_spikes(tmp_path, caplog):
    def guard():
        return NaNGuard(spike_factor=5.0, window=5, min_history=3)

    run(tmp_path, 10, [guard(), StopAt(6)])
    poison = Poison([7], "loss", 50.0)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        run(tmp_path, 10, [poison, guard()], ckpt_path="last")
    # the first step after the resume is judged against the 5 losses before the interruption
    assert same(poison.after[7], poison.before[7])
    assert any(
        r.message.startswith("NaNGuard: step 7: loss ") and "spiked above" in r.message
        for r in caplog.records
    )


def test_a_resumed_run_counts_the_rollbacks_made_before_it(tmp_path):
    def guard():
        return NaNGuard(rollback_after=2, max_rollbacks=1)

    checkpoints = ModelCheckpoint(every_n_steps=2, save_top_k=-1)
    _, first = run(tmp_path, 10, [Poison([3, 4]), checkpoints, guard(), StopAt(6)])
    assert first.state.restarts == 1 and first.global_step == 6
    # the one rollback allowed was spent before the interruption: the next streak ends the run
    with pytest.raises(
        RuntimeError, match=r"NaNGuard: 1 rollbacks did not help; 2 bad steps in a row again at step 9"
    ):
        run(
            tmp_path,
            12,
            [Poison([8, 9]), ModelCheckpoint(every_n_steps=2, save_top_k=-1), guard()],
            ckpt_path="last",
        )


def spike_messages(caplog):
    return [r.message for r in caplog.records if "spiked" in r.message]


def test_by_default_the_running_median_is_over_the_last_100_good_steps(tmp_path, caplog):
    # 51 steps at loss 1, then 50 at loss 3: the last 100 good steps hold 50 of each, median 2
    module = ScriptedLoss([1.0] * 51 + [3.0] * 50 + [100.0])
    with caplog.at_level(logging.WARNING, logger="trainer"):
        fit(
            module,
            regression_loader(batch_size=1, n=102),
            tmp_path,
            102,
            callbacks=[NaNGuard(spike_factor=10.0)],
            enable_checkpointing=False,
        )
    assert spike_messages(caplog) == [
        "NaNGuard: step 102: loss 100 spiked above 10.0 x the running median 2; update skipped "
        "(1 bad step(s) in a row)"
    ]


def test_a_resumed_run_counts_the_steps_skipped_before_it(tmp_path):
    run(tmp_path, 8, [Poison([3]), NaNGuard(), StopAt(5)])
    _, trainer = run(tmp_path, 8, [Poison([7]), NaNGuard()], ckpt_path="last")
    assert read_metrics(tmp_path, "nan_guard/skipped_steps") == {2: 1, 6: 2}
    assert trainer.callback_metrics["nan_guard/skipped_steps"] == 2


class TwoAlikeRanks(SingleDeviceStrategy):
    """One process standing in for a world of two ranks that see the same losses: a sum over the world
    counts each value twice."""

    def group_size(self, name):
        return 2 if name == "world" else super().group_size(name)

    def reduce(self, tensor, op="mean", *, group):
        out = super().reduce(tensor, op, group=group)
        return out * 2 if op == "sum" and group == "world" else out


def test_the_spike_warning_reports_the_mean_loss_over_ranks(tmp_path, caplog):
    module = ScriptedLoss([1.0, 1.0, 1.0, 2.5])
    guard = NaNGuard(spike_factor=2.0, window=5, min_history=3)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer = Trainer(
            strategy=TwoAlikeRanks(),
            max_steps=4,
            default_root_dir=tmp_path,
            enable_checkpointing=False,
            callbacks=[guard],
            **quiet(),
        )
        trainer.fit(module, regression_loader())
    assert spike_messages(caplog) == [
        "NaNGuard: step 4: loss 2.5 spiked above 2.0 x the running median 1; update skipped "
        "(1 bad step(s) in a row)"
    ]
