"""The Trainer's training state of named parts, its flags object and the fit loop's pure stop test (issue 51)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers import Regression, fit, regression_loader

from trainer.checkpoint.manager import CHECKPOINT_PARTS, ROLLBACK_PARTS
from trainer.fault_tolerance.state import REPLICA_PARTS
from trainer.flags import LoopFlags


def same(a, b) -> bool:
    """Nested dicts/lists/tuples of tensors and plain values, equal value for value."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_every_part_gives_back_what_it_captured(tmp_path):
    trainer = fit(Regression(dropout=0.2, optimizer="sgd"), regression_loader(), tmp_path, steps=3)
    state = trainer.training_state
    names = list(state.parts())
    assert set(names) == {*CHECKPOINT_PARTS, *REPLICA_PARTS} | {"model", "optimizer"}
    saved = copy.deepcopy(state.capture(names))
    # everything moves on: weights, optimizer, loop counters, RNG, schedule, data position
    trainer.save_checkpoint(tmp_path / "moved")  # RNG, counters and files untouched by a save
    with torch.no_grad():
        for p in trainer.module.parameters():
            p.add_(1.0)
    trainer.optimizer.param_groups[0]["lr"] = 5.0
    trainer.state.global_step, trainer.state.epoch = 99, 7
    trainer.lr_scheduler.step()
    torch.rand(3)
    assert not same(state.capture(names), saved)
    state.restore(copy.deepcopy(saved), [n for n in names if n != "data"])  # data: the fit's loader, pending
    again = state.capture(names)
    assert all(same(again[n], saved[n]) for n in names if n != "data"), [
        n for n in names if not same(again[n], saved[n])
    ]
    assert trainer.optimizer.param_groups[0]["lr"] == saved["optimizer"]["param_groups"][0]["lr"]


def test_a_rollback_restores_its_parts_and_rewinds_the_step_only(tmp_path):
    trainer = fit(Regression(optimizer="sgd"), regression_loader(), tmp_path, steps=4)
    trainer.state.epoch, trainer.state.samples_seen = 3, 1234
    restarts = trainer.state.restarts
    trainer.training_state.rewind_loop({"global_step": 2, "productive_s": 0.5, "epoch": 0})
    assert (trainer.global_step, trainer.state.productive_s) == (2, 0.5)
    assert (trainer.state.epoch, trainer.state.samples_seen, trainer.state.restarts) == (
        3,
        1234,
        restarts + 1,
    )
    assert set(ROLLBACK_PARTS) <= set(CHECKPOINT_PARTS) and "data" not in ROLLBACK_PARTS


def test_the_flags_are_one_typed_object_read_through_named_properties(tmp_path):
    trainer = fit(Regression(), regression_loader(), tmp_path, steps=1, limit_val_batches=3)
    assert isinstance(trainer.flags, LoopFlags)
    for field in dataclasses.fields(LoopFlags):
        assert field.name not in vars(trainer), field.name  # no attribute made behind a reader's back
        assert getattr(trainer, field.name) == getattr(trainer.flags, field.name)
    assert (trainer.max_steps, trainer.limit_val_batches) == (1, 3)
    with pytest.raises(AttributeError):
        trainer.max_steps = 5  # read-only: the flags were checked once


def test_done_is_a_pure_test_and_the_stop_reasons_are_polled_apart(tmp_path):
    trainer = fit(Regression(), regression_loader(), tmp_path, steps=2)
    loop = trainer._fit_loop
    trainer.flags = dataclasses.replace(trainer.flags, max_steps=10)  # the fit could go on
    trainer.strategy.stop_reason = lambda: "the privacy budget is spent"
    saver, saves = trainer.checkpoint_callback, []
    save = saver.save
    saver.save = lambda t: saves.append(t.global_step) or save(t)
    assert [loop.done for _ in range(3)] == [False] * 3  # asking saves nothing and stops nothing
    assert saves == [] and not trainer.should_stop
    loop.poll_stops()  # between steps: the reason stops the fit, after a checkpoint of the last step
    assert loop.done and trainer.should_stop and saves == [2]


def test_a_checkpoint_of_before_diloco_windows_were_saved_still_loads(tmp_path):
    """A state without the later part `outer_sync` loads (none was saved then); a missing part of old is an error."""
    trainer = fit(Regression(optimizer="sgd"), regression_loader(), tmp_path, steps=2)
    state = trainer.training_state.capture(CHECKPOINT_PARTS)
    assert state["outer_sync"] == {}  # no DiLoCo
    old = {name: part for name, part in state.items() if name != "outer_sync"}
    trainer.training_state.restore(old, [n for n in CHECKPOINT_PARTS if n != "data"])
    with pytest.raises(KeyError, match="loop"):
        trainer.training_state.restore({k: v for k, v in old.items() if k != "loop"}, ["loop"])
