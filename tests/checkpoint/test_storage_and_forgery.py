"""What the fault audit (.ci/fault_audit.py) found after the first round of fixes: a forged pickle whose manifest
hash was rewritten too, in a file validate and export never read; a newer checkpoint without meta.json passed
over without a word by validate; the storage refusing a write (a file-size limit) or an export path, told with
a traceback. Each is now one line naming the file."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from helpers import Regression, fit, regression_loader

from callbacks import ModelCheckpoint
from trainer import Trainer
from trainer import checkpoint as ckpt
from trainer.checkpoint.export import export_checkpoint
from trainer.checkpoint.integrity import hash_file
from trainer.cli import main


class Shell:
    """A pickle that runs a shell command when it is loaded by an unrestricted unpickler."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def forge(ckpt_dir: Path, name: str, payload: object) -> None:
    """Replace `name` with `payload` and rewrite its manifest entry, as a forger who knows the format would."""
    torch.save(payload, ckpt_dir / name)
    meta = json.loads((ckpt_dir / "meta.json").read_text())
    meta["manifest"][name] = hash_file(ckpt_dir / name)
    (ckpt_dir / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def run(tmp_path) -> Path:
    fit(Regression(), regression_loader(), tmp_path / "run", 4, callbacks=[ModelCheckpoint(every_n_steps=2)])
    return tmp_path / "run" / "checkpoints"


def test_a_forged_optimizer_file_is_refused_by_validate_and_export_which_never_read_it(run, tmp_path):
    marker = tmp_path / "MARKER"
    forge(run / "step-00000004", "optimizer.pt", {"state": Shell(f"touch {marker}")})
    trainer = Trainer(default_root_dir=tmp_path / "run", enable_progress_bar=False)
    with pytest.raises(
        ckpt.CheckpointError, match=r"optimizer.pt is refused: it holds the global posix.system"
    ):
        trainer.validate(Regression(), regression_loader(), ckpt_path=run / "step-00000004")
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer.pt is refused"):
        export_checkpoint(run / "step-00000004", tmp_path / "out")
    assert not marker.exists()


def test_validate_from_last_names_a_newer_checkpoint_without_meta_json(run, tmp_path, caplog):
    (run / "step-00000004" / "meta.json").unlink()
    trainer = Trainer(default_root_dir=tmp_path / "run", enable_progress_bar=False)
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer.validate(Regression(), regression_loader(), ckpt_path="last")
    said = "\n".join(r.message for r in caplog.records)
    assert (
        "skipped step-00000004: no meta.json" in said and "loading from" in said and "step-00000002" in said
    )


def test_a_write_the_storage_refuses_is_one_line_naming_the_folder_and_the_intact_checkpoint(run):
    failure = OSError(errno.EFBIG, "File too large", str(run / ".tmp-step-00000006-x" / "optimizer.pt"))
    said = ckpt.save_error(failure, run / "step-00000006")
    assert isinstance(said, ckpt.CheckpointError)
    assert str(said) == (
        f"checkpoint step-00000006 could not be written to {run}: file too large at optimizer.pt; "
        "the previous checkpoint step-00000004 is intact"
    )


def test_export_onto_a_file_is_one_line_and_leaves_the_file(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("the user's file")
    assert main(["export", str(run / "step-00000004"), str(out)]) == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1].startswith("trainer: error: [Errno 17] File exists")
    )
    assert out.read_text() == "the user's file"


def test_a_full_disk_during_export_names_the_output_folder(run, tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # as a write() says it: no file name

    monkeypatch.setattr(ckpt, "save_model_file", full)
    assert main(["export", str(run / "step-00000004"), str(tmp_path / "out")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"trainer: error: [Errno 28] No space left on device (writing {tmp_path / 'out'})", last
