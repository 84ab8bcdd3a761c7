"""A forged checkpoint never runs code: DCP's `.metadata`, a DCP byte item and a whole-file `optimizer.pt`,
each with a payload and the manifest hashes recomputed (anyone who can write the folder can), are refused
in one line naming the file on resume under DDP, `trainer validate` and `trainer export`."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import SMALL, TINY, Regression, quiet, regression_loader, run_cli
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from trainer import Trainer
from trainer.checkpoint import CheckpointError
from trainer.cli import main
from trainer.integrity import hash_file

# the tiny recipe on 2 DDP ranks, 2 steps: a real sharded (DCP) checkpoint in about 10 s
DDP = [
    *SMALL,
    "strategy.name=ddp",  # named: strategy auto plans the layout (trainer/config/plan_inputs.py)
    "trainer.devices=2",
    "data.global_batch_size=8",
    "trainer.warmup_steps=1",
    "trainer.val_at_start=false",
    "trainer.limit_val_batches=1",
]
WEIGHT = "model.model.norm.weight"  # a model tensor the forger re-declares as a byte item


class Payload:
    """What a forger pickles: unpickling it creates `sentinel` (any code could run instead)."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (open, (self.sentinel, "w"))


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`trainer ARGS` on 2 DDP ranks (the module fixture runs before the per-test TRAINER_CACHE is
    set, so the cache is named here)."""
    return run_cli(*args, cwd=cwd, ranks=2, TRAINER_CACHE=str(cwd / "trainer-cache"))


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def rehash(ckpt: Path, *files: Path) -> None:
    """Record the rewritten files' hashes in meta.json's manifest, as a forger would."""
    meta = json.loads((ckpt / "meta.json").read_text())
    for f in files:
        meta["manifest"][f.relative_to(ckpt).as_posix()] = hash_file(f)
    (ckpt / "meta.json").write_text(json.dumps(meta))


def rewrite_metadata(ckpt: Path, edit: Callable[[Metadata], object]) -> Path:
    """Apply `edit` to the DCP metadata (plain pickle: the test made this file) and re-hash it."""
    path = ckpt / "dcp" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))
    rehash(ckpt, path)
    return path


def forge_byte_item(ckpt: Path, fqn: str, value: object) -> Path:
    """Point item `fqn` at `torch.save(value)` bytes appended to its `.distcp` file, declared a byte item
    (what DCP stores `optim.param_groups.0.lr` as); returns that file."""
    metadata = pickle.loads((ckpt / "dcp" / ".metadata").read_bytes())
    keys = [k for k in metadata.storage_data if k.fqn == fqn]
    shard = ckpt / "dcp" / metadata.storage_data[keys[0]].relative_path
    blob = io.BytesIO()
    torch.save(value, blob)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob.getvalue())

    def point(md: Metadata) -> None:
        for key in keys:
            del md.storage_data[key]
        md.storage_data[MetadataIndex(fqn)] = _StorageInfo(shard.name, offset, len(blob.getvalue()))
        md.state_dict_metadata[fqn] = BytesStorageMetadata()

    rewrite_metadata(ckpt, point)
    rehash(ckpt, shard)
    return shard


def assert_refused(message: str, path: Path, sentinel: Path) -> None:
    """The payload never ran, and the user's last line names the forged file."""
    assert not sentinel.exists(), f"code from {path.name} ran"
    assert "\n" not in message.strip(), message
    assert str(path) in message and "refused" in message, message


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A legit checkpoint of a 2-rank DDP run of the tiny recipe."""
    cwd = tmp_path_factory.mktemp("ddp")
    done = cli(
        "fit", str(TINY), *DDP, "trainer.max_steps=2", f"trainer.default_root_dir={cwd / 'run'}", cwd=cwd
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd / "run" / "checkpoints" / "step-00000002"


@pytest.fixture
def ckpt(sharded: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "forged" / sharded.name
    shutil.copytree(sharded, copy)
    return copy


def resume_under_ddp(ckpt: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return cli(
        "fit",
        str(TINY),
        *DDP,
        "trainer.max_steps=3",
        f"trainer.default_root_dir={tmp_path / 'resumed'}",
        "--ckpt-path",
        str(ckpt),
        cwd=tmp_path,
    )


def validate(ckpt: Path, tmp_path: Path) -> int:
    """`trainer validate` of the tiny recipe from `ckpt`, in this process."""
    return main(
        [
            "validate",
            str(TINY),
            *SMALL,
            "trainer.limit_val_batches=1",
            f"trainer.default_root_dir={tmp_path / 'validated'}",
            "--ckpt-path",
            str(ckpt),
        ]
    )


@pytest.mark.slow
def test_forged_dcp_metadata_is_refused_on_ddp_resume_validate_and_export(ckpt, tmp_path, capsys):
    sentinel = tmp_path / "pwned"
    # a payload inside otherwise valid metadata: plain pickle would run it and then load normally
    path = rewrite_metadata(ckpt, lambda md: md.planner_data.update(x=Payload(sentinel)))

    done = resume_under_ddp(ckpt, tmp_path)
    assert_refused(last_line(done.stdout + done.stderr), path, sentinel)
    assert done.returncode != 0

    capsys.readouterr()
    assert validate(ckpt, tmp_path) == 2
    assert_refused(capsys.readouterr().err, path, sentinel)

    assert main(["export", str(ckpt), str(tmp_path / "export")]) == 2
    assert_refused(capsys.readouterr().err, path, sentinel)
    assert not (tmp_path / "export" / "model.safetensors").exists()


@pytest.mark.slow
def test_forged_optimizer_byte_item_is_refused_on_ddp_resume(ckpt, tmp_path):
    sentinel = tmp_path / "pwned"
    shard = forge_byte_item(ckpt, "optim.param_groups.0.lr", Payload(sentinel))
    done = resume_under_ddp(ckpt, tmp_path)
    message = last_line(done.stdout + done.stderr)
    assert_refused(message, shard, sentinel)
    assert "optim.param_groups.0.lr" in message and done.returncode != 0


@pytest.mark.slow
def test_forged_model_byte_item_is_refused_by_validate_and_never_exported(ckpt, tmp_path, capsys):
    sentinel = tmp_path / "pwned"
    shard = forge_byte_item(ckpt, WEIGHT, Payload(sentinel))
    assert validate(ckpt, tmp_path) == 2
    message = capsys.readouterr().err
    assert_refused(message, shard, sentinel)
    assert WEIGHT in message
    # export refuses a model entry that is not a tensor (skipping it wrote an incomplete model, exit 0)
    assert main(["export", str(ckpt), str(tmp_path / "export")]) == 2
    assert f"model entry {WEIGHT!r} is not stored as a tensor" in capsys.readouterr().err
    assert not sentinel.exists() and not (tmp_path / "export" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_byte_item_holding_a_plain_tensor_still_loads(sharded, ckpt, tmp_path, capsys):
    # the control for the refusals above: the same rewrite with a tensor is what weights_only allows
    from trainer.checkpoint_weights import dcp_model_state as _dcp_model_state

    forge_byte_item(ckpt, WEIGHT, _dcp_model_state(sharded)[WEIGHT.removeprefix("model.")])
    assert validate(sharded, tmp_path / "legit") == 0
    expected = capsys.readouterr().out
    assert validate(ckpt, tmp_path) == 0
    assert capsys.readouterr().out == expected and "val/loss" in expected


def test_forged_optimizer_file_is_refused_in_one_line_naming_it(tmp_path, capsys):
    sentinel = tmp_path / "pwned"
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    torch.save({"state": Payload(sentinel), "param_groups": []}, ckpt / "optimizer.pt")
    rehash(ckpt, ckpt / "optimizer.pt")
    with pytest.raises(CheckpointError) as err:
        Trainer(max_steps=4, default_root_dir=tmp_path, **quiet()).fit(
            Regression(), regression_loader(), ckpt_path="last"
        )
    assert_refused(str(err.value), ckpt / "optimizer.pt", sentinel)
