"""A forged checkpoint never runs code: DCP's `.metadata`, a DCP byte item, a whole-file `optimizer.pt` and
`state.pt`, each with a payload and the manifest hashes recomputed (anyone who can write the folder can),
are refused in one line naming the file on resume under DDP, `ckpt_path="last"`, `trainer validate` and
`trainer export`: no traceback, never torch's advice to load it with weights_only=False."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import traceback
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from helpers import SMALL, TINY, Regression, failure, quiet, regression_loader, run_cli
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from trainer import Trainer
from trainer.checkpoint import CheckpointError
from trainer.checkpoint.integrity import hash_file
from trainer.cli import main

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


class Call:
    """What a forger pickles: unpickling it calls `fn(*args)`."""

    def __init__(self, fn: Callable, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


class Renaming(pickle._Pickler):
    """The pure-Python pickler, writing the callable `fn` as the global (module, name) given: how a forger
    reaches a callable through a module the metadata allows (`pathlib` + `os.mkdir`)."""

    def __init__(self, file, fn: Callable, module: str, name: str) -> None:
        super().__init__(file, protocol=4)  # 4: a dotted name is looked up attribute by attribute
        self.fn, self.as_global = fn, (module, name)

    def save_global(self, obj, name=None):
        if obj is not self.fn:
            return super().save_global(obj, name)
        self.save(self.as_global[0])
        self.save(self.as_global[1])
        self.write(pickle.STACK_GLOBAL)

    dispatch = {**pickle._Pickler.dispatch, types.FunctionType: save_global}  # functions bypass the method


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
    assert done.returncode == 0, failure(done.stderr)
    return cwd / "run" / "checkpoints" / "step-00000002"


@pytest.fixture
def ckpt(sharded: Path, tmp_path: Path) -> Path:
    """A copy of it, in the checkpoint folder of a run root (tmp_path/forged) that `last` reads."""
    copy = tmp_path / "forged" / "checkpoints" / sharded.name
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
    output = done.stdout + done.stderr
    assert_refused(last_line(output), path, sentinel)
    assert done.returncode != 0
    # DCP itself logged each refusal as tracebacks, then failed with "metadata is None"
    assert "Traceback" not in output and "metadata is None" not in output, output[-3000:]

    capsys.readouterr()
    assert validate(ckpt, tmp_path) == 2
    assert_refused(capsys.readouterr().err, path, sentinel)

    assert main(["export", str(ckpt), str(tmp_path / "export")]) == 2
    assert_refused(capsys.readouterr().err, path, sentinel)
    assert not (tmp_path / "export" / "model.safetensors").exists()


@pytest.mark.slow
def test_forged_dcp_metadata_under_last_is_said_in_one_line_naming_it(ckpt, tmp_path):
    sentinel = tmp_path / "pwned"
    path = rewrite_metadata(ckpt, lambda md: md.planner_data.update(x=Payload(sentinel)))
    done = cli(
        "fit",
        str(TINY),
        *DDP,
        "trainer.max_steps=3",
        f"trainer.default_root_dir={tmp_path / 'forged'}",
        "--ckpt-path",
        "last",
        cwd=tmp_path,
    )
    output = done.stdout + done.stderr
    assert not sentinel.exists(), "code from the forged .metadata ran"
    assert "Traceback" not in output and "metadata is None" not in output, output[-3000:]
    said = [line for line in output.splitlines() if str(path) in line]
    assert said and all("refused" in line for line in said), output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "name", "fn"),
    [
        ("pathlib", "os.mkdir", os.mkdir),  # a module the metadata needs, and a callable reached through it
        ("torch.distributed.checkpoint.metadata", "os.mkdir", os.mkdir),
        ("torch", "save", torch.save),  # a name of an allowed module that is not on the list
    ],
)
def test_dcp_metadata_allows_module_and_name_pairs_not_whole_modules(
    ckpt, tmp_path, capsys, module, name, fn
):
    sentinel = tmp_path / "pwned"
    call = Call(fn, {}, str(sentinel)) if fn is torch.save else Call(fn, str(sentinel))
    path = ckpt / "dcp" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    metadata.planner_data["x"] = (
        call  # otherwise valid metadata: a module-wide allow-list loads it, and runs it
    )
    forged = io.BytesIO()
    Renaming(forged, fn, module, name).dump(metadata)
    path.write_bytes(forged.getvalue())
    rehash(ckpt, path)
    assert main(["export", str(ckpt), str(tmp_path / "export")]) == 2
    message = capsys.readouterr().err
    assert_refused(message, path, sentinel)
    assert f"{module}.{name}" in message
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
    from trainer.checkpoint.weights import dcp_model_state as _dcp_model_state

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


def test_a_forged_state_file_fails_a_script_without_torchs_advice(tmp_path):
    sentinel = tmp_path / "pwned"
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    torch.save({"loop": Payload(sentinel)}, ckpt / "state.pt")
    rehash(ckpt, ckpt / "state.pt")
    with pytest.raises(CheckpointError) as err:
        Trainer(max_steps=4, default_root_dir=tmp_path / "resumed", **quiet()).fit(
            Regression(), regression_loader(), ckpt_path=str(ckpt)
        )
    assert_refused(str(err.value), ckpt / "state.pt", sentinel)
    shown = "".join(traceback.format_exception(err.value))  # what a script that does not catch it prints
    assert "weights_only" not in shown and shown.count("Traceback") == 1, shown


@pytest.mark.slow
def test_a_forged_state_file_is_one_line_for_fit_last_and_validate(tmp_path, capsys):
    sentinel = tmp_path / "pwned"
    recipe = yaml.safe_load(TINY.read_text())
    recipe["callbacks"][0]["init_args"]["every_n_steps"] = 2
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(recipe))
    run = [str(tmp_path / "tiny.yaml"), *SMALL, "trainer.limit_val_batches=1", "trainer.val_at_start=false"]
    root = f"trainer.default_root_dir={tmp_path / 'run'}"
    assert main(["fit", *run, "trainer.max_steps=4", "trainer.warmup_steps=1", root]) == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000004"
    torch.save({"loop": Payload(sentinel)}, ckpt / "state.pt")
    rehash(ckpt, ckpt / "state.pt")
    capsys.readouterr()

    validated = f"trainer.default_root_dir={tmp_path / 'validated'}"
    assert main(["validate", *run, validated, "--ckpt-path", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert_refused(last_line(err), ckpt / "state.pt", sentinel)
    assert "Traceback" not in err and "weights_only" not in err

    # "last" passes over it, naming it in one line, and resumes the older checkpoint
    more = ["trainer.max_steps=6", "trainer.warmup_steps=1", root, "--ckpt-path", "last"]
    done = run_cli("fit", *run, *more, cwd=tmp_path)
    output = done.stdout + done.stderr
    said = [line for line in output.splitlines() if str(ckpt / "state.pt") in line]
    assert done.returncode == 0 and len(said) == 1 and "refused" in said[0], output[-3000:]
    assert "Traceback" not in output and "weights_only" not in output
    assert not sentinel.exists()
