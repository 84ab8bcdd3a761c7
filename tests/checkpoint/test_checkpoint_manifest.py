"""The manifest in meta.json is the allow-list of a checkpoint's files: a file it does not list (its entry
removed, or a file swapped in from another checkpoint) is refused in one line naming it, by a resume, by
`ckpt_path="last"` (which falls back to the older good checkpoint), by `trainer validate` and by `trainer
export`, which verify the whole checkpoint before reading any part of it. Bytes appended to a listed file
fail its hash as well as its size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import SMALL, TINY, Regression, fit, params, regression_loader

from callbacks import ModelCheckpoint
from trainer.checkpoint import CheckpointError
from trainer.checkpoint.integrity import first_mismatch, units
from trainer.cli import main


def unlist(ckpt: Path, name: str) -> None:
    """Remove `name`'s entry from the checkpoint's manifest (meta.json is not hashed: anyone can)."""
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["manifest"][name]
    (ckpt / "meta.json").write_text(json.dumps(meta))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def swap_in_older(ckpt: Path, name: str) -> None:
    """Copy `name` from the checkpoint two steps older over this one's (a valid file of the wrong step)."""
    older = ckpt.parent / f"step-{int(ckpt.name.split('-')[1]) - 2:08d}"
    shutil.copyfile(older / name, ckpt / name)


def saved_every_2(root: Path, steps: int, ckpt_path: str | None = None) -> Regression:
    torch.manual_seed(0)  # the same initial weights in every run
    module = Regression()
    fit(
        module,
        regression_loader(),
        root,
        steps,
        callbacks=[ModelCheckpoint(every_n_steps=2)],
        ckpt_path=ckpt_path,
    )
    return module


@pytest.fixture(scope="module")
def run4(tmp_path_factory) -> Path:
    """A fit of 4 steps (AdamW: its optimizer state matters) with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("run4")
    saved_every_2(root, 4)
    return root


@pytest.fixture
def run(run4: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run4, copy)
    return copy


def one_line_naming(message: str, ckpt: Path, name: str) -> None:
    assert "\n" not in message.strip(), message
    assert str(ckpt) in message and name in message and "manifest" in message, message


@pytest.mark.parametrize("forge", [flip_byte, swap_in_older], ids=["flipped-byte", "older-step's"])
def test_an_optimizer_file_missing_from_the_manifest_is_refused_naming_it(run, forge):
    ckpt = run / "checkpoints" / "step-00000004"
    unlist(ckpt, "optimizer.pt")
    forge(ckpt / "optimizer.pt") if forge is flip_byte else forge(ckpt, "optimizer.pt")
    with pytest.raises(CheckpointError) as err:
        saved_every_2(run / "resumed", 6, ckpt_path=str(ckpt))
    one_line_naming(str(err.value), ckpt, "optimizer.pt")


def test_last_passes_over_a_checkpoint_with_an_unlisted_file_and_resumes_the_good_one(run, tmp_path, caplog):
    ckpt = run / "checkpoints" / "step-00000004"
    unlist(ckpt, "optimizer.pt")
    swap_in_older(ckpt, "optimizer.pt")  # step 2's moments with step 4's weights: a silently different run
    resumed = saved_every_2(run, 6, ckpt_path="last")
    assert "optimizer.pt is not in meta.json's manifest" in caplog.text
    # resumed from step 2, exactly as if never interrupted (from step 4 with step 2's optimizer it is not)
    uninterrupted = saved_every_2(tmp_path / "uninterrupted", 6)
    assert all(a.equal(b) for a, b in zip(params(resumed), params(uninterrupted), strict=True))


def test_bytes_appended_to_a_file_fail_its_hash_not_only_its_size(run):
    ckpt = run / "checkpoints" / "step-00000004"
    with open(ckpt / "optimizer.pt", "ab") as f:
        f.write(b"\0" * 16)
    manifest = json.loads((ckpt / "meta.json").read_text())["manifest"]
    # the hashes alone (what verifies a file whatever its size check says) catch the appended bytes
    size = manifest["optimizer.pt"]["bytes"]
    assert first_mismatch(ckpt, units(manifest)) == (
        f"optimizer.pt checksum mismatch at bytes 0-{size} (corrupted or altered)"
    )
    with pytest.raises(CheckpointError) as err:
        saved_every_2(run / "resumed", 6, ckpt_path=str(ckpt))
    assert "optimizer.pt has" in str(err.value) and "truncated or altered" in str(err.value)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny recipe's checkpoint after 2 steps (whole files: one process)."""
    root = tmp_path_factory.mktemp("tiny")
    args = ["trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.val_at_start=false"]
    assert (
        main(
            [
                "fit",
                str(TINY),
                *SMALL,
                *args,
                "trainer.limit_val_batches=1",
                f"trainer.default_root_dir={root}",
            ]
        )
        == 0
    )
    return root / "checkpoints" / "step-00000002"


def test_validate_and_export_verify_every_file_even_those_they_never_read(tiny_ckpt, tmp_path, capsys):
    ckpt = tmp_path / tiny_ckpt.name
    shutil.copytree(tiny_ckpt, ckpt)
    unlist(ckpt, "optimizer.pt")
    flip_byte(ckpt / "optimizer.pt")  # neither command reads the optimizer: only the manifest sees it
    capsys.readouterr()
    validate = ["validate", str(TINY), *SMALL, "trainer.limit_val_batches=1", "--ckpt-path", str(ckpt)]
    assert main([*validate, f"trainer.default_root_dir={tmp_path / 'validated'}"]) == 2
    err = capsys.readouterr().err
    one_line_naming(err.strip().splitlines()[-1], ckpt, "optimizer.pt")
    assert "Traceback" not in err

    assert main(["export", str(ckpt), str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    one_line_naming(err.strip().splitlines()[-1], ckpt, "optimizer.pt")
    assert not (tmp_path / "export" / "model.safetensors").exists()
