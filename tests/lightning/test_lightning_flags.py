"""Trainer flags under Lightning's names and meanings: logger=, check_val_every_n_epoch, max_time,
fast_dev_run."""

from __future__ import annotations

import datetime
import json

import pytest
import torch
from helpers import FakeClock, Regression, fake_time, quiet, read_metrics, regression_data
from torch.utils.data import DataLoader

from trainer import Trainer


def loader(n=64):
    return DataLoader(regression_data(n), batch_size=16)


def test_check_val_every_n_epoch_validates_every_nth_epoch(tmp_path):
    Trainer(max_epochs=4, check_val_every_n_epoch=2, default_root_dir=tmp_path, **quiet()).fit(
        Regression(), loader(32), loader(16)
    )
    assert sorted(read_metrics(tmp_path, "val/loss")) == [4, 8]  # after epochs 2 and 4 (2 steps each)


@pytest.mark.parametrize(
    "max_time",
    ["00:00:00:05", {"seconds": 5}, datetime.timedelta(seconds=5)],
    ids=["str", "dict", "timedelta"],
)
def test_max_time_stops_the_fit_when_the_time_is_up(tmp_path, monkeypatch, max_time):
    clock = FakeClock()
    for module in (
        "trainer.loop.fit_loop",
        "trainer.loop.stopping",
    ):  # the start, and the polls between steps
        fake_time(monkeypatch, module, clock, "time")

    class Slow(Regression):
        def training_step(self, batch, batch_idx):
            clock.advance(2.0)  # each step takes 2 s of the fake clock
            return super().training_step(batch, batch_idx)

    trainer = Trainer(max_epochs=10, max_time=max_time, default_root_dir=tmp_path, **quiet())
    trainer.fit(Slow(), loader())
    assert trainer.global_step == 3  # 6 s >= 5 s after the third step


def test_fast_dev_run_runs_one_batch_of_each_loop_and_writes_no_checkpoint(tmp_path):
    seen = []

    class Counts(Regression):
        def validation_step(self, batch, batch_idx):
            seen.append(batch_idx)
            return super().validation_step(batch, batch_idx)

    trainer = Trainer(fast_dev_run=True, max_epochs=5, default_root_dir=tmp_path, **quiet())
    trainer.fit(Counts(), loader(), loader())
    assert trainer.global_step == 1 and seen == [0]
    assert not (tmp_path / "checkpoints").exists()
    assert (
        len(
            Trainer(fast_dev_run=2, default_root_dir=tmp_path, **quiet()).predict(
                Regression(), DataLoader(torch.randn(64, 8), batch_size=16)
            )
        )
        == 2
    )


def test_logger_false_keeps_only_the_jsonl_log_and_logger_is_lightnings_name_for_loggers(tmp_path):
    trainer = Trainer(max_steps=1, logger=False, default_root_dir=tmp_path, **quiet())
    assert [type(lg).__name__ for lg in trainer.loggers] == ["JSONLLogger"]
    trainer.fit(Regression(), loader())
    assert json.loads((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    with pytest.raises(ValueError, match=r"both logger= and loggers=; allowed: one of the two"):
        Trainer(logger="jsonl", loggers=["jsonl"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_time": "5 minutes"}, r"max_time='5 minutes' is invalid; allowed: 'DD:HH:MM:SS'"),
        ({"max_time": {"fortnights": 1}}, r"max_time=\{'fortnights': 1\} is invalid"),
        ({"check_val_every_n_epoch": 0}, r"check_val_every_n_epoch=0 is invalid"),
        ({"fast_dev_run": -1}, r"fast_dev_run=-1 is invalid"),
    ],
)
def test_bad_lightning_flags_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Trainer(**kwargs)


def test_gradient_clip_val_zero_is_accepted_and_negative_is_not():
    assert Trainer(gradient_clip_val=0).gradient_clip_val is None
    with pytest.raises(
        ValueError, match=r"gradient_clip_val=-1 is invalid; allowed: a number > 0, or 0/None"
    ):
        Trainer(gradient_clip_val=-1)


class Shuffled(Regression):
    """Dropout and a shuffled loader: the run reads the RNG; validation records what it saw."""

    def __init__(self):
        super().__init__(dropout=0.3)
        self.validated: list[tuple[bool, int]] = []  # (sanity check?, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.validated.append((self.trainer.sanity_checking, batch_idx))
        self.log("val_seen", float(batch_idx))
        return super().validation_step(batch, batch_idx)


def sanity_run(tmp_path, steps, expected):
    """Fit one epoch with `num_sanity_val_steps=steps`; returns the final weights."""
    torch.manual_seed(0)
    module = Shuffled()
    trainer = Trainer(
        max_epochs=1,
        num_sanity_val_steps=steps,
        default_root_dir=tmp_path,
        seed=3,
        enable_checkpointing=False,
        **quiet(),
    )
    trainer.fit(module, DataLoader(regression_data(64), batch_size=16, shuffle=True), loader())
    assert [i for sanity, i in module.validated if sanity] == expected
    assert [i for sanity, i in module.validated if not sanity] == [0, 1, 2, 3]  # the epoch's validation
    assert sorted(read_metrics(tmp_path, "val_seen")) == [4]  # nothing kept from the check
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize("steps, expected", [(2, [0, 1]), (-1, [0, 1, 2, 3])])
def test_num_sanity_val_steps_validates_that_many_batches_first_and_changes_nothing(
    tmp_path, steps, expected
):
    assert torch.equal(
        sanity_run(tmp_path / "with", steps, expected), sanity_run(tmp_path / "without", 0, [])
    )


def test_a_broken_validation_step_fails_before_the_first_training_step(tmp_path):
    class Broken(Regression):
        def validation_step(self, batch, batch_idx):
            raise RuntimeError("typo in validation_step")

    module = Broken()
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, **quiet())
    with pytest.raises(RuntimeError, match="typo in validation_step"):
        trainer.fit(module, loader(), loader())
    assert trainer.global_step == 0


def test_num_sanity_val_steps_below_minus_one_is_named():
    with pytest.raises(ValueError, match="num_sanity_val_steps"):
        Trainer(num_sanity_val_steps=-2)
