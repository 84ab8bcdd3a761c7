"""Checkpoints that "last" cannot resume from are set aside (`discarded-step-...`), never deleted and never
in the way: every one of them when none is good, one with a deleted file or without a usable meta.json,
one whose meta.json lies about its step. The run then saves on its schedule, and only its own superseded
checkpoints are deleted. What is no checkpoint at all (a file) is left where it is, and the save refused."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from helpers import SMALL, TINY, Regression, fit, regression_loader

from callbacks import Callback, ModelCheckpoint
from trainer import checkpoint as ckpt
from trainer.checkpoint import CheckpointError
from trainer.cli import main


def run(root: Path, steps: int, ckpt_path=None, spy=None):
    torch.manual_seed(0)  # the same initial weights in every run of a test
    module = Regression()
    callbacks = [ModelCheckpoint(every_n_steps=2, save_top_k=2), *([spy] if spy else [])]
    fit(module, regression_loader(), root, steps, ckpt_path=ckpt_path, callbacks=callbacks)
    return module


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))


class Listing(Callback):
    """The checkpoint folder as each step ends."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.seen = folder, {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen[trainer.global_step] = listing(self.folder)


def test_when_every_checkpoint_is_bad_all_are_set_aside_and_the_fresh_start_saves_on_schedule(tmp_path):
    straight = run(tmp_path / "straight", 8)
    root = tmp_path / "run"
    folder = root / "checkpoints"
    run(root, 6)
    assert listing(folder) == ["step-00000004", "step-00000006"]
    for name in listing(folder):
        flip_a_byte(folder / name / ckpt.OPTIMIZER_FILE)
    bad = {name: tree(folder / name) for name in listing(folder)}
    spy = Listing(folder)
    resumed = run(root, 8, ckpt_path="last", spy=spy)
    aside = ["discarded-step-00000004", "discarded-step-00000006"]
    assert spy.seen[2] == [*aside, "step-00000002"]  # nothing of the new run's is in the way of its saves
    assert spy.seen[4] == [*aside, "step-00000002", "step-00000004"]
    assert spy.seen[6] == [*aside, "step-00000004", "step-00000006"]  # only its own superseded one went
    assert listing(folder) == [*aside, "step-00000006", "step-00000008"]
    for name, files in bad.items():  # kept as they were, for inspection
        assert tree(folder / f"discarded-{name}") == files
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)  # started from scratch, really: the same as an uninterrupted run


def test_a_checkpoint_whose_meta_json_claims_an_older_ones_step_does_not_hide_that_one(tmp_path, caplog):
    straight = run(tmp_path / "straight", 8)
    root = tmp_path / "run"
    folder = root / "checkpoints"
    run(root, 6)
    forged = folder / "step-00000006" / ckpt.META_FILE
    forged.write_text(json.dumps({**json.loads(forged.read_text()), "step": 4}))
    forged_bytes = tree(forged.parent)
    with caplog.at_level(logging.INFO, logger="trainer"):
        resumed = run(root, 8, ckpt_path="last")
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "skipped step-00000006: failed to load" in said and "meta.json says step 4" in said
    assert f"resuming from {folder / 'step-00000004'}: step 4" in said  # the genuine one, not step 2
    assert listing(folder) == ["discarded-step-00000006", "step-00000006", "step-00000008"]
    assert tree(folder / "discarded-step-00000006") == forged_bytes  # the forged one, set aside as it was
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_with_a_deleted_file_is_set_aside_and_the_cli_run_goes_on(tmp_path, caplog):
    root = tmp_path / "run"
    folder = root / "checkpoints"
    recipe = [
        str(TINY),
        *SMALL,
        "trainer.warmup_steps=1",
        "trainer.limit_val_batches=1",
        f"trainer.default_root_dir={root}",
        "callbacks=[{class_path: callbacks.ModelCheckpoint, init_args: {every_n_steps: 2, save_top_k: -1}}]",
    ]
    assert main(["fit", *recipe, "trainer.max_steps=4"]) == 0
    (folder / "step-00000004" / ckpt.STATE_FILE).unlink()
    incomplete = tree(folder / "step-00000004")
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert main(["fit", *recipe, "trainer.max_steps=6", "--ckpt-path", "last"]) == 0
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "skipped step-00000004: incomplete: missing state.pt" in said
    assert "resuming from" in said and "step-00000002: step 2" in said
    assert listing(folder) == ["discarded-step-00000004", "step-00000002", "step-00000004", "step-00000006"]
    assert tree(folder / "discarded-step-00000004") == incomplete
    assert ckpt.check_good(folder / "step-00000004")["step"] == 4  # the run's own, written again
    # and the next resume starts where this one ended
    assert main(["fit", *recipe, "trainer.max_steps=8", "--ckpt-path", "last"]) == 0
    assert listing(folder)[-1] == "step-00000008"


@pytest.mark.parametrize("damage", ["meta.json deleted", "meta.json cut short", "emptied"])
def test_a_newer_checkpoint_without_a_usable_meta_json_is_set_aside_and_the_run_goes_on(tmp_path, damage):
    root = tmp_path / "run"
    folder = root / "checkpoints"
    run(root, 6)
    step6 = folder / "step-00000006"
    meta = step6 / ckpt.META_FILE
    if damage == "meta.json deleted":
        meta.unlink()
    elif damage == "meta.json cut short":
        meta.write_bytes(meta.read_bytes()[:40])
    else:
        shutil.rmtree(step6)
        step6.mkdir()
    damaged = tree(step6)
    run(root, 8, ckpt_path="last")
    assert listing(folder) == ["discarded-step-00000006", "step-00000006", "step-00000008"]
    assert tree(folder / "discarded-step-00000006") == damaged
    assert ckpt.check_good(step6)["step"] == 6


def test_a_file_where_a_checkpoint_goes_is_never_moved_nor_replaced(tmp_path):
    root = tmp_path / "run"
    folder = root / "checkpoints"
    run(root, 6)
    shutil.rmtree(folder / "step-00000006")
    (folder / "step-00000006").write_text("the user's notes")
    with pytest.raises(CheckpointError) as err:
        run(root, 8, ckpt_path="last")
    assert str(err.value) == (
        f"{folder / 'step-00000006'} already exists and is no checkpoint this run can replace (a file, not "
        "a checkpoint directory); it is not replaced: move it away or save under another path"
    )
    assert (folder / "step-00000006").read_text() == "the user's notes"
    assert listing(folder) == ["step-00000004", "step-00000006"]
