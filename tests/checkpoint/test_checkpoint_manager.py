"""CheckpointManager as a unit: what it lists, saves, resolves and deletes in a run's folder, after one small
fit (its ModelCheckpoint saved steps 2, 4, 6 through the manager). Another run's checkpoint is made by
copying one and naming another run in its meta.json: its files are as good as the original's."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from helpers import Regression, quiet, regression_loader

from callbacks import ModelCheckpoint
from trainer import Trainer
from trainer import checkpoint as ckpt
from trainer.checkpoint import CheckpointError


@pytest.fixture
def trained(tmp_path) -> Trainer:
    trainer = Trainer(
        max_steps=6,
        seed=0,
        default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(every_n_steps=2, save_top_k=-1)],
        **quiet(),
    )
    trainer.fit(Regression(), regression_loader())
    return trainer


def edit_meta(path: Path, **fields) -> None:
    meta = json.loads((path / ckpt.META_FILE).read_text())
    (path / ckpt.META_FILE).write_text(json.dumps({**meta, **fields}))


def foreign_copy(source: Path, target: Path) -> Path:
    """A copy of `source` that another run wrote."""
    shutil.copytree(source, target)
    edit_meta(target, run_id="another-run")
    return target


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_the_manager_owns_the_folder_the_fit_claimed_and_lists_only_this_runs_checkpoints(trained, tmp_path):
    manager = trained.checkpoint_manager
    folder = tmp_path / "checkpoints"
    assert manager.folder == trained.checkpoint_dir == folder
    assert manager.run_id == trained.run_id is not None
    foreign_copy(folder / "step-00000006", folder / "step-00000008")
    own = manager.own(folder)
    assert [(c.path.name, c.step, c.good) for c in own] == [
        ("step-00000002", 2, True),
        ("step-00000004", 4, True),
        ("step-00000006", 6, True),
    ]
    assert manager.path_for(10) == folder / "step-00000010"


def test_saving_twice_replaces_its_own_checkpoint_but_never_another_runs(trained, tmp_path):
    manager = trained.checkpoint_manager
    folder = tmp_path / "checkpoints"
    first = manager.save()
    second = manager.save(meta={"note": "again"})  # the same step: its own checkpoint, replaced
    assert first == second == folder / "step-00000006"
    assert ckpt.read_meta(second)["note"] == "again" and ckpt.check_good(second)["step"] == 6
    theirs = foreign_copy(second, folder / "step-00000007")
    before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    with pytest.raises(CheckpointError, match="already exists and was written by run another-run"):
        manager.save(theirs)
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before


def test_prune_deletes_only_this_runs_checkpoints_in_the_folder_it_is_given(trained, tmp_path):
    manager = trained.checkpoint_manager
    folder = tmp_path / "checkpoints"
    theirs = foreign_copy(folder / "step-00000004", folder / "step-00000005")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = Path(shutil.copytree(folder / "step-00000006", elsewhere / "step-00000006"))  # this run's, moved
    manager.prune([folder / "step-00000002", theirs, moved], folder)
    assert names(folder) == ["step-00000004", "step-00000005", "step-00000006"]
    assert names(elsewhere) == ["step-00000006"]  # not in the folder asked about: kept


def test_discarding_a_future_sets_aside_only_this_runs_newer_checkpoints(trained, tmp_path):
    folder = tmp_path / "checkpoints"
    foreign_copy(folder / "step-00000006", folder / "step-00000009")
    trained.checkpoint_manager.discard_newer(2, folder)
    assert names(folder) == [
        "discarded-step-00000004",
        "discarded-step-00000006",
        "step-00000002",
        "step-00000009",
    ]


def test_resolve_last_is_the_newest_good_checkpoint_and_names_the_damaged_ones_it_passed(trained, tmp_path):
    manager = trained.checkpoint_manager
    folder = tmp_path / "checkpoints"
    assert manager.resolve("last") == (folder / "step-00000006", [])
    assert manager.resolve("last", before_step=6) == (folder / "step-00000004", [])
    with open(folder / "step-00000006" / ckpt.MODEL_FILE, "r+b") as f:
        f.truncate(10)
    path, skipped = manager.resolve("last")
    assert path == folder / "step-00000004"
    assert len(skipped) == 1 and skipped[0].startswith(f"step-00000006: {ckpt.MODEL_FILE} has 10 bytes, ")
    assert skipped[0].endswith("were written (truncated or altered)")


def test_resolve_best_ranks_this_runs_scored_checkpoints_by_mode_and_skips_damaged_ones(trained, tmp_path):
    manager = trained.checkpoint_manager
    folder = tmp_path / "checkpoints"
    for step, score in ((2, 0.5), (4, 0.1), (6, 0.9)):
        edit_meta(folder / f"step-{step:08d}", score=score)
    foreign_copy(folder / "step-00000004", folder / "step-00000008")
    edit_meta(folder / "step-00000008", score=0.0)  # the best score, but another run's
    assert manager.resolve("best", mode="min") == (folder / "step-00000004", [])
    assert manager.resolve("best", mode="max") == (folder / "step-00000006", [])
    with open(folder / "step-00000004" / ckpt.OPTIMIZER_FILE, "r+b") as f:
        f.truncate(10)
    path, skipped = manager.resolve("best", mode="min")
    assert path == folder / "step-00000002"
    assert len(skipped) == 1 and skipped[0].startswith(f"step-00000004: {ckpt.OPTIMIZER_FILE} has 10 bytes, ")


def test_resolve_refuses_what_it_cannot_name(trained):
    with pytest.raises(ValueError, match=r"resolve\('first', mode='min'\); allowed: 'last' or 'best'"):
        trained.checkpoint_manager.resolve("first")
    with pytest.raises(ValueError, match="mode 'min' or 'max'"):
        trained.checkpoint_manager.resolve("best", mode="lowest")


def tree(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `folder`: its mode and bytes (read as root reads, whatever the mode)."""
    return {
        p.relative_to(folder).as_posix(): (p.stat().st_mode, p.read_bytes() if p.is_file() else b"")
        for p in sorted(folder.rglob("*"))
    }


class Killed(BaseException):
    """The process dying: nothing it would still do (no except clause, no clean-up) happens."""


def fail_renames_into(monkeypatch, final: Path, error: BaseException, then_dead: bool = False) -> None:
    """os.rename/os.replace of a staging directory onto `final` raise `error`; `then_dead`: so does every
    rename after it (the process is gone)."""
    dead = []
    for name in ("rename", "replace"):
        real = getattr(os, name)

        def failing(src, dst, *args, _real=real, **kwargs):
            if dead or (Path(dst) == final and Path(src).name.startswith(".tmp-")):
                dead.extend([True] if then_dead else [])
                raise error
            return _real(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, name, failing)


def test_a_replace_that_fails_to_rename_into_place_leaves_the_replaced_checkpoint_intact(
    trained, tmp_path, monkeypatch
):
    folder = tmp_path / "checkpoints"
    step6 = folder / "step-00000006"
    before = tree(step6)
    fail_renames_into(monkeypatch, step6, OSError(errno.EIO, "Input/output error"))
    with pytest.raises(CheckpointError) as err:
        trained.save_checkpoint(step6)  # this run's own checkpoint, at its own step: it may be replaced
    monkeypatch.undo()
    assert str(err.value) == (
        f"checkpoint step-00000006 could not be renamed into place in {folder} (Input/output error); "
        "the checkpoint it was to replace is intact"
    )
    assert tree(step6) == before and ckpt.check_good(step6)["step"] == 6
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def test_a_replace_killed_between_its_renames_loses_nothing_the_next_fit_puts_the_old_one_back(
    trained, tmp_path, monkeypatch, caplog
):
    folder = tmp_path / "checkpoints"
    step6 = folder / "step-00000006"
    before = tree(step6)
    fail_renames_into(monkeypatch, step6, Killed(), then_dead=True)
    with pytest.raises(Killed):
        trained.save_checkpoint(step6)
    monkeypatch.undo()
    assert not step6.exists()  # killed between moving the old one aside and renaming the new one in
    trainer = Trainer(
        max_steps=8,
        seed=0,
        default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(every_n_steps=2, save_top_k=-1)],
        **quiet(),
    )
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer.fit(Regression(), regression_loader(), ckpt_path="last")
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "put back step-00000006, which a dead writer had moved aside" in said
    assert f"resuming from {step6}: step 6" in said
    assert tree(step6) == before


@pytest.mark.parametrize("what", ["not a checkpoint", "corrupted meta.json", "no run id", "mode 000"])
def test_a_folder_at_the_save_path_whose_owner_cannot_be_read_is_never_replaced(trained, tmp_path, what):
    folder = tmp_path / "checkpoints"
    theirs = folder / "step-00000008"
    if what == "not a checkpoint":
        theirs.mkdir()
        (theirs / "notes.txt").write_text("the user's, not a checkpoint")
    else:
        shutil.copytree(folder / "step-00000006", theirs)
        if what == "corrupted meta.json":
            (theirs / ckpt.META_FILE).write_text('{"step": 8, "run_id": "')
        elif what == "no run id":  # written before runs had ids: nobody's to replace
            edit_meta(theirs, run_id=None)
        else:  # unreadable to a user (root still reads it: then its run id, another run's, refuses it)
            edit_meta(theirs, run_id="another-run")
    before = tree(theirs)
    theirs.chmod(0 if what == "mode 000" else 0o755)
    try:
        with pytest.raises(CheckpointError) as err:
            trained.save_checkpoint(theirs)
    finally:
        theirs.chmod(0o755)
    said = str(err.value)
    assert said.startswith(f"{theirs} already exists and is no checkpoint this run can replace (") or (
        what in ("no run id", "mode 000") and said.startswith(f"checkpoint {theirs} already exists and was")
    ), said
    assert "\n" not in said and "it is not replaced" in said
    assert tree(theirs) == before
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []
