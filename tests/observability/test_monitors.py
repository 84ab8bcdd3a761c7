"""EarlyStopping, LearningRateMonitor and the effective-training-time metric."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from helpers import Regression, quiet, read_metrics, regression_loader

from callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from trainer import Trainer


class Plateau(Regression):
    """Validation loss follows a script, so when early stopping triggers is known in advance."""

    def __init__(self, losses):
        super().__init__()
        self.losses, self.calls = list(losses), 0

    def validation_step(self, batch, batch_idx):
        return torch.tensor(self.losses[min(self.calls, len(self.losses) - 1)])

    def on_fit_start(self):
        self.calls = 0


class CountValidations(EarlyStopping):
    def on_validation_end(self, trainer, module):
        module.calls += not trainer.sanity_checking  # as a Lightning callback skips the sanity check
        super().on_validation_end(trainer, module)


def test_early_stopping_after_patience_validations_without_improvement(tmp_path, caplog):
    module = Plateau([1.0, 0.8, 0.79, 0.85, 0.81, 0.5])
    stopper = CountValidations(patience=3, min_delta=0.05)
    trainer = Trainer(
        max_steps=100, val_check_interval=2, default_root_dir=tmp_path, callbacks=[stopper], **quiet()
    )
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer.fit(module, regression_loader(), regression_loader())
    # 1.0, 0.8 (better), 0.79/0.85/0.81 (not better by 0.05): stop at the 5th validation, step 10
    assert trainer.global_step == 10 and stopper.stopped_at == 10 and stopper.best == pytest.approx(0.8)
    assert any("early stopping at step 10" in r.message for r in caplog.records)


def test_early_stopping_stops_at_once_on_a_non_finite_metric(tmp_path):
    module = Plateau([1.0, float("nan")])
    trainer = Trainer(
        max_steps=100,
        val_check_interval=2,
        default_root_dir=tmp_path,
        callbacks=[CountValidations()],
        **quiet(),
    )
    trainer.fit(module, regression_loader(), regression_loader())
    assert trainer.global_step == 4


def test_early_stopping_names_a_missing_metric(tmp_path):
    # checked where Lightning checks it: at the end of the (validated) training epoch
    trainer = Trainer(
        max_epochs=1,
        limit_train_batches=2,
        default_root_dir=tmp_path,
        callbacks=[EarlyStopping("val/acc")],
        **quiet(),
    )
    with pytest.raises(
        KeyError, match="EarlyStopping\\(monitor='val/acc'\\) found no such metric; logged: .*val/loss"
    ):
        trainer.fit(Regression(), regression_loader(), regression_loader())


class TwoGroups(Regression):
    def configure_optimizers(self):
        first, second = self.net[0], self.net[3]
        return torch.optim.AdamW(
            [
                {"params": first.parameters(), "lr": 1e-2, "name": "first"},
                {"params": second.parameters(), "lr": 1e-3},
            ]
        )


def test_lr_monitor_logs_each_group_the_rate_its_step_used(tmp_path):
    trainer = Trainer(
        max_steps=6,
        lr_schedule="linear",
        warmup_steps=2,
        default_root_dir=tmp_path,
        callbacks=[LearningRateMonitor(every_n_steps=2, log_momentum=True)],
        **quiet(),
    )
    trainer.fit(TwoGroups(), regression_loader())
    first, second = read_metrics(tmp_path, "lr/first"), read_metrics(tmp_path, "lr/group1")
    assert sorted(first) == [2, 4, 6]
    # the monitor reports what the step used: the Trainer's own train/lr is group 0's rate of the same step
    assert first == {k: v for k, v in read_metrics(tmp_path, "train/lr").items() if k in first}
    assert second[4] == pytest.approx(first[4] / 10)
    assert read_metrics(tmp_path, "momentum/first") == {2: 0.9, 4: 0.9, 6: 0.9}


def test_effective_training_time_is_logged_and_kept_across_a_restart(tmp_path, caplog):
    first = Trainer(
        max_steps=4, default_root_dir=tmp_path, callbacks=[ModelCheckpoint(every_n_steps=2)], **quiet()
    )
    first.fit(Regression(), regression_loader())
    fraction = read_metrics(tmp_path, "train/effective_time")
    assert sorted(fraction) == [1, 2, 3, 4] and all(0 < v <= 1 for v in fraction.values())
    second = Trainer(max_steps=6, default_root_dir=tmp_path, **quiet())
    with caplog.at_level(logging.INFO, logger="trainer"):
        second.fit(Regression(), regression_loader(), ckpt_path="last")
    # wall-clock counts from the first start, less the moments between the checkpoint and the resume
    assert first.state.started_at < second.state.started_at < time.time()
    assert second.state.restarts == 1
    assert second.state.productive_s > first.state.productive_s
    assert any("effective training time" in r.message and "1 restart(s)" in r.message for r in caplog.records)


def test_the_time_a_run_sat_stopped_is_not_counted_in_its_effective_training_time(tmp_path, monkeypatch):
    first = Trainer(max_steps=4, default_root_dir=tmp_path, **quiet())
    first.fit(Regression(), regression_loader())
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 10 * 3600)  # resumed ten hours later
    second = Trainer(max_steps=8, default_root_dir=tmp_path, **quiet())
    second.fit(Regression(), regression_loader(), ckpt_path="last")
    effective = second.effective_training_time()
    assert effective["wall_s"] < 3600 and effective["fraction"] > 0.01, effective


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: EarlyStopping(patience=-1), "patience=-1 is invalid; allowed: an int >= 0"),
        (lambda: EarlyStopping(mode="up"), "mode='up' is invalid; allowed: 'min' or 'max'"),
        (lambda: LearningRateMonitor(every_n_steps=0), "every_n_steps=0 is invalid"),
    ],
)
def test_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()
