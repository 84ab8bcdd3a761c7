"""A run's files have one owner: fine-tuning from a run, copying a run folder, two fits at once, a fresh fit
in an old folder, a tampered meta.json, dead writers' leftovers and a full disk never lose a checkpoint."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers import TESTS, Regression, failure, launch_env, quiet, regression_loader, run_commands, run_ranks

from callbacks import Callback, ModelCheckpoint
from trainer import Trainer
from trainer import checkpoint as ckpt
from trainer.checkpoint import CheckpointError, integrity
from trainer.checkpoint.integrity import hash_file
from trainer.checkpoint.run_folder import FolderInUse


def tree(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `root`: equal trees are byte-identical."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def run(root: Path, steps: int, ckpt_path=None, **kwargs) -> Trainer:
    callbacks = kwargs.pop("callbacks", None) or [ModelCheckpoint(every_n_steps=2, save_top_k=2)]
    trainer = Trainer(max_steps=steps, default_root_dir=root, seed=0, callbacks=callbacks, **quiet(**kwargs))
    trainer.fit(Regression(), regression_loader(), ckpt_path=ckpt_path)
    return trainer


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_fine_tuning_from_another_runs_checkpoint_leaves_that_run_byte_identical(tmp_path):
    run(tmp_path / "orig", 6)
    before = tree(tmp_path / "orig")
    run(tmp_path / "fork", 10, ckpt_path=tmp_path / "orig" / "checkpoints" / "step-00000006")
    assert tree(tmp_path / "orig") == before  # it used to be emptied, the loaded checkpoint included
    assert names(tmp_path / "fork" / "checkpoints") == ["step-00000008", "step-00000010"]


def test_a_copied_run_folder_resumes_as_its_own_run_and_the_original_is_untouched(tmp_path):
    run(tmp_path / "orig", 6)
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    before = tree(tmp_path / "orig")
    trainer = run(tmp_path / "copy", 12, ckpt_path="last")
    assert trainer.global_step == 12
    assert tree(tmp_path / "orig") == before
    assert names(tmp_path / "copy" / "checkpoints") == ["step-00000010", "step-00000012"]  # save_top_k=2


class FitInside(Callback):
    """At step 2, runs a second fit into the same folder while this one is live, and records what happened."""

    def __init__(self, root: Path) -> None:
        self.root, self.refused = root, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 2 and self.refused is None:
            try:
                run(self.root, 4)
            except FolderInUse as err:
                self.refused = str(err)


def test_a_second_live_fit_into_the_same_folder_is_refused_in_one_line_naming_the_holder(tmp_path):
    inside = FitInside(tmp_path)
    first = run(tmp_path, 6, callbacks=[ModelCheckpoint(every_n_steps=2, save_top_k=-1), inside])
    folder = tmp_path / "checkpoints"
    assert inside.refused.startswith(f"checkpoint folder {folder} is in use by run {first.run_id} (pid ")
    assert "\n" not in inside.refused
    assert names(folder) == ["step-00000002", "step-00000004", "step-00000006"]  # the first's, all there
    assert all(ckpt.run_of(folder / n) == first.run_id for n in names(folder))


DDP_FIT = """
import argparse, sys
sys.path.insert(0, {tests!r})
from helpers import Regression, quiet, regression_loader
from trainer import Trainer
parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, required=True)
devices = parser.parse_args().devices
Trainer(strategy="ddp", devices=devices, accelerator="cpu", max_steps=4, default_root_dir={root!r}, **quiet()).fit(
    Regression(), regression_loader()
)
"""


class HoldUntil(Callback):
    """At step 2, says so and waits (no timeout needed: the test always releases it) for `release`."""

    def __init__(self) -> None:
        self.reached, self.release = threading.Event(), threading.Event()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            self.reached.set()
            self.release.wait()


def test_a_ddp_fit_into_a_folder_a_live_fit_holds_is_refused_and_the_first_keeps_its_checkpoints(tmp_path):
    hold, errors = HoldUntil(), []

    def first() -> None:
        try:
            run(tmp_path, 4, callbacks=[ModelCheckpoint(every_n_steps=1, save_top_k=-1), hold])
        except BaseException as err:  # reported below, on the test's thread
            errors.append(err)
            hold.reached.set()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        hold.reached.wait()
        script = tmp_path / "ddp_fit.py"
        script.write_text(DDP_FIT.format(tests=str(TESTS), root=str(tmp_path)))
        done = run_ranks(2, script, timeout=300, check=False)
    finally:
        hold.release.set()
        thread.join()
    assert not errors
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert f"checkpoint folder {tmp_path / 'checkpoints'} is in use by run " in last, done.stderr[-2000:]
    assert names(tmp_path / "checkpoints") == [f"step-0000000{i}" for i in (1, 2, 3, 4)]


def test_a_fresh_fit_in_a_folder_of_an_earlier_run_keeps_it_and_its_summary_names_only_its_own(
    tmp_path, capsys
):
    from trainer.cli import _report

    run(tmp_path, 8)
    before = tree(tmp_path / "checkpoints")
    trainer = run(tmp_path, 4)
    assert {
        k: v for k, v in tree(tmp_path / "checkpoints").items() if not k.startswith("version_1/")
    } == before
    own = tmp_path / "checkpoints" / "version_1"
    assert trainer.checkpoint_dir == own and names(own) == ["step-00000002", "step-00000004"]
    _report(trainer, None)
    lines = capsys.readouterr().out
    assert str(own / "step-00000004") in lines and "step-00000008" not in lines
    # "last" keeps meaning "this run": the same command resumes version_1, not the earlier run's step 8
    assert run(tmp_path, 6, ckpt_path="last").checkpoint_dir == own
    assert names(own) == ["step-00000004", "step-00000006"]


def test_a_save_never_replaces_a_checkpoint_another_run_wrote(tmp_path):
    run(tmp_path / "a", 2)
    theirs = tmp_path / "a" / "checkpoints" / "step-00000002"
    before = tree(theirs)
    trainer = run(tmp_path / "b", 2)
    with pytest.raises(
        CheckpointError, match=r"already exists and was written by run \w+; it is not replaced"
    ):
        trainer.save_checkpoint(theirs)
    assert tree(theirs) == before


def rewrite_meta(ckpt_dir: Path, **changes) -> None:
    meta = json.loads((ckpt_dir / "meta.json").read_text())
    meta.update(changes)
    (ckpt_dir / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("manifest", [None, {}])
def test_a_checkpoint_whose_manifest_was_removed_or_emptied_is_refused_with_one_line(tmp_path, manifest):
    run(tmp_path, 2)
    step2 = tmp_path / "checkpoints" / "step-00000002"
    if manifest is None:
        meta = json.loads((step2 / "meta.json").read_text())
        del meta["manifest"]
        (step2 / "meta.json").write_text(json.dumps(meta))
    else:
        rewrite_meta(step2, manifest=manifest)
    weights = step2 / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # a flipped weight byte that only the hashes would catch
    weights.write_bytes(bytes(raw))
    why = "has no manifest" if manifest is None else "lists no file"
    with pytest.raises(CheckpointError, match=rf"^checkpoint '{step2}': meta.json {why}, so nothing") as err:
        Trainer(default_root_dir=tmp_path, **quiet()).validate(
            Regression(), regression_loader(), ckpt_path=step2
        )
    assert "\n" not in str(err.value)


def test_a_meta_json_whose_step_was_edited_is_refused(tmp_path):
    run(tmp_path, 6, callbacks=[ModelCheckpoint(every_n_steps=6)])
    step6 = tmp_path / "checkpoints" / "step-00000006"
    rewrite_meta(step6, step=99)
    with pytest.raises(CheckpointError, match=r"meta.json says step 99 but its loop state is at step 6"):
        run(tmp_path / "other", 8, ckpt_path=step6)


def test_last_falls_back_past_a_checkpoint_with_an_empty_manifest_and_a_deleted_file(tmp_path, caplog):
    run(tmp_path, 4, callbacks=[ModelCheckpoint(every_n_steps=2, save_top_k=-1)])
    step4 = tmp_path / "checkpoints" / "step-00000004"
    rewrite_meta(step4, manifest={}, files=[])
    (step4 / "optimizer.pt").unlink()
    trainer = run(tmp_path, 6, ckpt_path="last", callbacks=[ModelCheckpoint(every_n_steps=2, save_top_k=-1)])
    assert trainer.state.restarts == 1
    assert any("skipped step-00000004: meta.json lists no file" in r.getMessage() for r in caplog.records)
    assert any(
        "resuming from" in r.getMessage() and "step-00000002" in r.getMessage() for r in caplog.records
    )


def test_what_a_killed_save_left_is_removed_at_the_next_start_and_a_half_replaced_checkpoint_put_back(
    tmp_path,
):
    run(tmp_path, 2)
    folder = tmp_path / "checkpoints"
    dead = folder / ".tmp-step-00000004-0123456789ab-999999"  # a dead writer's: full size, never finished
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 4096)
    (folder / "step-00000002").rename(folder / ".old-step-00000002-0123456789ab-999999")
    run(tmp_path, 4, ckpt_path="last")
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert names(folder) == ["step-00000002", "step-00000004"]


class FullDiskAt:
    """From the `step`-th save on, every file write fails as a full disk would, mid-file."""

    def __init__(self, monkeypatch, after_bytes: int = 1000) -> None:
        real = integrity.HashingFile.write
        self.armed = False

        def write(f, data):
            if self.armed and f.size + len(memoryview(data).cast("B")) > after_bytes:
                f.error = OSError(errno.ENOSPC, "No space left on device")
                raise f.error
            return real(f, data)

        monkeypatch.setattr(integrity.HashingFile, "write", write)


class ArmAt(Callback):
    def __init__(self, disk: FullDiskAt, step: int) -> None:
        self.disk, self.step = disk, step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.disk.armed = trainer.global_step >= self.step


@pytest.mark.parametrize("on_save_error", ["stop", "continue"])
def test_a_full_disk_is_one_line_the_previous_checkpoint_stays_loadable_and_nothing_is_left_behind(
    tmp_path, monkeypatch, on_save_error
):
    disk = FullDiskAt(monkeypatch)
    saver = ModelCheckpoint(every_n_steps=2, save_top_k=-1, on_save_error=on_save_error)
    callbacks = [ArmAt(disk, 3), saver]  # before the saver: armed by the time step 4 is saved
    folder = tmp_path / "checkpoints"
    if on_save_error == "stop":
        with pytest.raises(CheckpointError) as err:
            run(tmp_path, 6, callbacks=callbacks)
        said = str(err.value)
        assert said.startswith(
            f"checkpoint step-00000004 could not be written to {folder}: no space left on device"
        )
        assert "MiB free); the previous checkpoint step-00000002 is intact" in said and "\n" not in said
    else:
        trainer = run(tmp_path, 6, callbacks=callbacks)
        assert trainer.global_step == 6  # trained on without the checkpoints it could not write
    assert names(folder) == ["step-00000002"]
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".tmp")]
    disk.armed = False
    assert ckpt.check_good(folder / "step-00000002")["step"] == 2


def test_a_full_disk_under_a_real_tmpfs_is_one_line(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mount)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (the ENOSPC writer test above covers the logic)")
    try:
        script = tmp_path / "fill.py"
        script.write_text(
            textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            import torch
            from helpers import regression_loader, quiet, Regression
            from callbacks import ModelCheckpoint
            from trainer import Trainer

            class Wide(Regression):
                def __init__(self):
                    super().__init__()
                    self.pad = torch.nn.Parameter(torch.zeros(6000))  # ~70 KiB with AdamW: two fit, three do not

            Trainer(max_steps=6, default_root_dir={str(mount)!r}, callbacks=[ModelCheckpoint(every_n_steps=2, save_top_k=-1)],
                    **quiet()).fit(Wide(), regression_loader())
            """)
        )
        done = run_commands([([sys.executable, str(script)], launch_env())], str(tmp_path), 120)
        assert done.returncode != 0
        last = done.stderr.strip().splitlines()[-1]
        assert "could not be written to" in last and "no space left on device" in last, failure(done.stderr)
        assert "is intact" in last
        folder = mount / "checkpoints"
        assert not [p.name for p in folder.iterdir() if p.name.startswith(".tmp")]
        good, _ = ckpt.find_last_good(folder)  # what "last" would resume: the previous one, intact
        assert good is not None and ckpt.check_good(good)
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_hash_file_matches_what_a_save_records(tmp_path):
    """The tests above forge manifests with hash_file: it must agree with the hashes taken while writing."""
    run(tmp_path, 2)
    step2 = tmp_path / "checkpoints" / "step-00000002"
    manifest = ckpt.read_meta(step2)["manifest"]
    assert all(hash_file(step2 / name) == entry for name, entry in manifest.items())


def test_the_lock_a_crashed_fit_left_is_taken_over_with_a_note_and_a_copied_one_silently(tmp_path, caplog):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    dead = {"host": "h1", "pid": 999999, "run_id": "deadbeef0000", "since": "2026-01-01 00:00:00"}
    (folder / ".lock").write_text(json.dumps({**dead, "folder": str(folder.resolve())}))
    with caplog.at_level(logging.WARNING, logger="trainer"):
        run(tmp_path, 2)
    took = [r.getMessage() for r in caplog.records if "took over the lock" in r.getMessage()]
    assert took == [
        f"took over the lock of {folder} from run deadbeef0000 (pid 999999 on host h1, since "
        "2026-01-01 00:00:00), which is gone"
    ]
    assert not (folder / ".lock").exists()  # released at the end of the fit
    caplog.clear()
    (folder / ".lock").write_text(json.dumps({**dead, "folder": "/elsewhere/checkpoints"}))  # copied along
    with caplog.at_level(logging.WARNING, logger="trainer"):
        run(tmp_path, 4, ckpt_path="last")
    assert not [r for r in caplog.records if "took over" in r.getMessage()]
