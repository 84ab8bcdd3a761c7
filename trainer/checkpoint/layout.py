"""Checkpoint layout: the names inside a checkpoint directory, its meta.json, and finding a folder's checkpoints.

A checkpoint is a directory `step-00000120/` holding `model.safetensors`, `optimizer.pt`, `state.pt`
(loop counters, RNG, scheduler, scaler, data position, callback state) and `meta.json`; a sharded one
holds each rank's own shards under `dcp/` instead of the first two. A directory with that final name and
a meta.json is complete (trainer/checkpoint/staging.py renames it into place only once written). A
ModelCheckpoint `filename` template names it otherwise (`epoch=3-val_loss=0.12/`); its step is then the
one its meta.json records. Names starting with "." (being written), `bad-` or `discarded-` (set aside)
and links (a `last` entry) are never listed as checkpoints.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import integrity

FORMAT_VERSION = 1  # the file layout; manifest entries: block hashes ({...}) or, before, [bytes, sha256]

META_FILE = "meta.json"

MODEL_FILE = "model.safetensors"

OPTIMIZER_FILE = "optimizer.pt"

STATE_FILE = "state.pt"

DCP_DIR = "dcp"  # a sharded checkpoint's torch.distributed.checkpoint files, each rank's own

VALIDATED_FILE = "validated.json"

_STEP_DIR = re.compile(r"^step-(\d+)$")

Entries = dict[str, Any]  # {path relative to the checkpoint: manifest entry}, as HashingFile.entry() gives


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit the model; `reason` says why
    without the checkpoint's path."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


_SET_ASIDE = ("bad-", "discarded-")


def step_of(ckpt_dir: Path) -> int:
    """The step of a checkpoint directory: in its name (`step-00000120` -> 120), else in its meta.json
    (-1 when that is unreadable: it sorts oldest, and verifying it names what is wrong)."""
    m = _STEP_DIR.match(Path(ckpt_dir).name)
    if m is not None:
        return int(m.group(1))
    try:
        return int(json.loads((Path(ckpt_dir) / META_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def _is_named(path: Path) -> bool:
    """A directory named by a filename template that could be a checkpoint (not a staging directory, a
    checkpoint set aside, a run folder or a link)."""
    name = path.name
    return (
        _STEP_DIR.match(name) is None
        and not name.startswith(".")
        and not name.startswith(_SET_ASIDE)
        and not path.is_symlink()
        and (path / META_FILE).exists()
    )


def meta_for(state: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """meta.json fields of a checkpoint of the trainer `state` (Trainer.save_checkpoint's, which always has
    "loop" and "meta"): its step and what the Trainer asked to record."""
    return {"step": state["loop"]["global_step"], **state["meta"], **extra}


def require_exists(ckpt_dir: Path) -> None:
    """FileNotFoundError naming what is allowed, unless the user's `ckpt_dir` exists."""
    if not Path(ckpt_dir).exists():
        raise FileNotFoundError(
            f"checkpoint path '{ckpt_dir}' does not exist; allowed: an existing checkpoint directory, 'last' or None"
        )


def read_meta(ckpt_dir: Path) -> dict[str, Any]:
    """meta.json of a checkpoint whose files are all there; its absence means the directory was never
    completed."""
    ckpt_dir = Path(ckpt_dir)
    meta = _meta_json(ckpt_dir)
    missing = [name for name in meta.get("files", []) if not (ckpt_dir / name).exists()]
    if missing:
        why = f"incomplete: missing {', '.join(missing)}"
        raise CheckpointError(f"checkpoint '{ckpt_dir}' is {why}", reason=why)
    return meta


def _meta_json(ckpt_dir: Path) -> dict[str, Any]:
    """meta.json of a checkpoint directory, whatever became of the files it lists."""
    ckpt_dir = Path(ckpt_dir)
    require_exists(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(
            f"checkpoint path '{ckpt_dir}' is a file; a checkpoint is a directory like step-00000100/",
            reason="a file, not a checkpoint directory",
        )
    try:
        meta = json.loads((ckpt_dir / META_FILE).read_text())
    except FileNotFoundError as err:
        why = f"no {META_FILE}: it was never completed"
        raise CheckpointError(f"checkpoint '{ckpt_dir}' has {why}", reason=why) from err
    except ValueError as err:  # not JSON, or not text at all
        why = f"{META_FILE} corrupted ({err})"
        raise CheckpointError(
            f"checkpoint '{ckpt_dir}' has a corrupted {META_FILE} ({err})", reason=why
        ) from err
    except OSError as err:  # a directory this process may not read: nothing in it can be checked
        why = f"{META_FILE} unreadable ({err.strerror})"
        raise CheckpointError(f"checkpoint '{ckpt_dir}': {why}", reason=why) from err
    if not isinstance(meta, dict):
        why = f"{META_FILE} corrupted (a JSON {type(meta).__name__}, not an object)"
        raise CheckpointError(f"checkpoint '{ckpt_dir}' has a corrupted {META_FILE}", reason=why)
    return meta


def run_of(ckpt_dir: Path | None) -> str | None:
    """The id of the run that wrote a checkpoint, complete or not (a deleted file does not change who
    wrote it); None: no readable meta.json, or written before runs had ids."""
    try:
        return _meta_json(ckpt_dir).get("run_id") if ckpt_dir is not None else None
    except (CheckpointError, OSError):
        return None


def unfinished(ckpt_dir: Path) -> str | None:
    """Why a directory this process can read holds no usable meta.json (none: it was never completed; not
    JSON: it was damaged), or None: it has one, or it is a file, a link or a directory it may not read."""
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.is_symlink() or not ckpt_dir.is_dir():
        return None
    try:
        _meta_json(ckpt_dir)
    except CheckpointError as err:
        return err.reason if isinstance(err.__cause__, (FileNotFoundError, ValueError)) else None
    return None


def unfinished_steps(directory: Path) -> list[tuple[Path, str]]:
    """(folder, why) of each `step-N` folder under `directory` with no usable meta.json, newest first: no
    checkpoint, but worth a word when "last" passes over it."""
    directory = Path(directory)
    found = [p for p in directory.iterdir() if _STEP_DIR.match(p.name)] if directory.is_dir() else []
    return [(p, why) for p in sorted(found, key=step_of, reverse=True) if (why := unfinished(p))]


def manifest_bytes(ckpt_dir: Path | None) -> int:
    """The bytes a checkpoint's manifest lists (0 for None or an unreadable checkpoint)."""
    try:
        manifest = read_meta(ckpt_dir)["manifest"] if ckpt_dir is not None else {}
    except (CheckpointError, FileNotFoundError, KeyError):
        return 0
    return sum(integrity.expected_size(entry) for entry in manifest.values())


def find_last(directory: Path) -> Path | None:
    """The completed checkpoint with the highest step under `directory`, or None (nothing is verified)."""
    done = completed(directory)
    return done[0] if done else None


def newer_than(directory: Path, step: int) -> list[Path]:
    """Checkpoint directories (complete or not) under `directory` of a step > `step`."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return [
        p
        for p in directory.iterdir()
        if ((m := _STEP_DIR.match(p.name)) and int(m.group(1)) > step) or (_is_named(p) and step_of(p) > step)
    ]


def completed(directory: Path) -> list[Path]:
    """Checkpoint directories with a meta.json, newest (highest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    done = [
        (step_of(p), p.name, p)
        for p in directory.iterdir()
        if (_STEP_DIR.match(p.name) and not p.is_symlink() and (p / META_FILE).exists()) or _is_named(p)
    ]
    return [p for _, _, p in sorted(done, reverse=True)]


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors (a DTensor's local shard) in a nested state: about what saving it writes."""
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return t.numel() * t.element_size()
    return 0
