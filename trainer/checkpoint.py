"""Checkpoint files: atomic directories of safetensors weights + `weights_only` torch files, and finding "last".

A checkpoint is a directory `step-00000120/` holding `model.safetensors`, `optimizer.pt`, `state.pt`
(loop counters, RNG, scheduler, scaler, data position, callback state) and `meta.json`. It is written
under a temporary name and renamed into place, so a directory with the final name is always complete;
nothing in it can run code when loaded (safetensors, and `torch.load(weights_only=True)`).

meta.json carries a manifest: the size and SHA-256 of every file, so a file truncated or altered after
the save is found before it is loaded. A checkpoint saved with `pending_validation` is *good* only
once `validated.json` exists (ModelCheckpoint writes it after reloading the checkpoint and comparing
losses); one that failed validation is renamed `bad-step-XXXXXXXX` and kept for inspection.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
META_FILE = "meta.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.pt"
VALIDATED_FILE = "validated.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
log = logging.getLogger("trainer")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit the model."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def meta_for(state: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """meta.json fields of a checkpoint of the trainer `state` (Trainer.save_checkpoint's, which always has
    "loop" and "meta"): its step and what the Trainer asked to record."""
    return {"step": state["loop"]["global_step"], **state["meta"], **extra}


def write_atomically(
    final_dir: Path, write: Callable[[Path], None], meta: dict[str, Any], staged: Path | None = None
) -> Path:
    """Run `write(tmp_dir)`, add meta.json, then rename tmp_dir to `final_dir` (replacing an older one).
    `staged`: a temporary directory other writers (every rank's shards) already filled."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = staged or final_dir.parent / f".tmp-{final_dir.name}-{os.getpid()}"
    if staged is None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    write(tmp)
    meta = {"format": FORMAT_VERSION, "time": time.time(), **meta}
    meta["files"] = sorted(p.name for p in tmp.iterdir())
    meta["manifest"] = manifest(tmp)
    _write_synced(tmp / META_FILE, json.dumps(meta, indent=1).encode())
    old = final_dir.parent / f".old-{final_dir.name}-{os.getpid()}"
    if final_dir.exists():
        os.rename(final_dir, old)
    os.rename(tmp, final_dir)
    shutil.rmtree(old, ignore_errors=True)
    _fsync(final_dir.parent)
    return final_dir


def save_model_file(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Write tensors to safetensors; tensors sharing memory (tied weights) are stored once, as aliases."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"state_dict entry {name!r} is a {type(value).__name__}; only tensors can be saved"
            )
        key = (
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            tuple(value.stride()),
        )
        if key in seen and value.numel() > 0:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = value.detach().contiguous()
    save_file(tensors, str(path), metadata={"aliases": json.dumps(aliases)})
    _fsync(path)


def load_model_file(path: Path) -> dict[str, torch.Tensor]:
    """Read what `save_model_file` wrote (aliases restored as references to the same tensor)."""
    path = Path(path)
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint file {path} is unreadable, truncated or corrupted ({err})"
        ) from err
    for name, target in aliases.items():
        tensors[name] = tensors[target]
    return tensors


def save_torch_file(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    _fsync(path)


def load_torch_file(path: Path) -> Any:
    """`torch.load` that never runs code from the file and says which file is broken."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete") from err
    except Exception as err:  # torch raises RuntimeError/UnpicklingError/EOFError for damaged files
        raise CheckpointError(
            f"checkpoint file {path} is unreadable, truncated or corrupted ({err})"
        ) from err


def manifest(directory: Path) -> dict[str, list]:
    """{relative path: [bytes, sha256 hex]} of every file under `directory` but the markers themselves."""
    directory = Path(directory)
    return {
        p.relative_to(directory).as_posix(): [p.stat().st_size, file_sha256(p)]
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.relative_to(directory).as_posix() not in (META_FILE, VALIDATED_FILE)
    }


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify(ckpt_dir: Path) -> dict[str, Any]:
    """meta.json of a checkpoint whose every file has its recorded size and SHA-256; CheckpointError if not."""
    meta = read_meta(ckpt_dir)
    for name, (size, digest) in meta.get("manifest", {}).items():
        path = Path(ckpt_dir) / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint '{ckpt_dir}' is incomplete: {name} is missing")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"checkpoint '{ckpt_dir}': {name} has {actual} bytes, {size} were written (truncated or altered)"
            )
        if file_sha256(path) != digest:
            raise CheckpointError(
                f"checkpoint '{ckpt_dir}': {name} does not match its SHA-256 from the save (corrupted or altered)"
            )
    return meta


def check_good(ckpt_dir: Path) -> None:
    """Raise CheckpointError unless the checkpoint is complete, intact and, if it awaited validation, validated."""
    meta = verify(ckpt_dir)
    if meta.get("pending_validation") and not (Path(ckpt_dir) / VALIDATED_FILE).exists():
        raise CheckpointError(
            f"checkpoint '{ckpt_dir}' was never validated (the run stopped during validation?)"
        )


def mark_validated(ckpt_dir: Path, report: dict[str, Any]) -> None:
    """Record that the checkpoint passed validation (atomically: the file is complete or absent)."""
    tmp = Path(ckpt_dir) / f".{VALIDATED_FILE}.tmp"
    _write_synced(tmp, json.dumps(report, indent=1).encode())
    os.rename(tmp, Path(ckpt_dir) / VALIDATED_FILE)
    _fsync(Path(ckpt_dir))


def mark_bad(ckpt_dir: Path) -> Path:
    """Move a checkpoint that failed validation out of the way of "last" (kept, for inspection)."""
    ckpt_dir = Path(ckpt_dir)
    bad = ckpt_dir.with_name(f"bad-{ckpt_dir.name}")
    shutil.rmtree(bad, ignore_errors=True)
    os.rename(ckpt_dir, bad)
    _fsync(ckpt_dir.parent)
    return bad


def read_meta(ckpt_dir: Path) -> dict[str, Any]:
    """meta.json of a checkpoint; its absence means the directory was never completed."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.exists():
        raise FileNotFoundError(
            f"checkpoint path '{ckpt_dir}' does not exist; allowed: an existing checkpoint directory, 'last' or None"
        )
    if not ckpt_dir.is_dir():
        raise CheckpointError(
            f"checkpoint path '{ckpt_dir}' is a file; a checkpoint is a directory like step-00000100/"
        )
    try:
        meta = json.loads((ckpt_dir / META_FILE).read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint '{ckpt_dir}' has no {META_FILE}: it was never completed") from err
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint '{ckpt_dir}' has a corrupted {META_FILE} ({err})") from err
    missing = [name for name in meta.get("files", []) if not (ckpt_dir / name).exists()]
    if missing:
        raise CheckpointError(f"checkpoint '{ckpt_dir}' is incomplete: missing {', '.join(missing)}")
    return meta


def find_last(directory: Path) -> Path | None:
    """The completed checkpoint with the highest step under `directory`, or None (nothing is verified)."""
    done = _completed(directory)
    return done[0] if done else None


def find_last_good(directory: Path, before_step: int | None = None) -> Path | None:
    """The newest checkpoint under `directory` (of a step < `before_step`) that passes `check_good`, or
    None. Each newer one that fails is skipped with a warning that says why (corrupted, truncated, never
    validated)."""
    for path in _completed(directory):
        if before_step is not None and int(_STEP_DIR.match(path.name).group(1)) >= before_step:
            continue
        try:
            check_good(path)
            return path
        except CheckpointError as err:
            log.warning(f"skipping a bad checkpoint: {err}")
    return None


def newer_than(directory: Path, step: int) -> list[Path]:
    """Checkpoint directories (complete or not) under `directory` of a step > `step`."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if (m := _STEP_DIR.match(p.name)) and int(m.group(1)) > step]


def _completed(directory: Path) -> list[Path]:
    """Checkpoint directories with a meta.json, newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    done = [
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / META_FILE).exists()
    ]
    return [p for _, p in sorted(done, reverse=True)]


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory entry's) data to disk so a crash cannot leave a half-written name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
