"""Checkpoint files: atomic directories of safetensors weights + `weights_only` torch files, and finding "last".

A checkpoint is a directory `step-00000120/` holding `model.safetensors`, `optimizer.pt`, `state.pt`
(loop counters, RNG, scheduler, scaler, data position, callback state) and `meta.json`; a sharded one
holds each rank's own shards under `dcp/` instead of the first two. It is written under a temporary name
and renamed into place, so a directory with the final name is always complete; nothing in it can run
code when loaded (safetensors, and `torch.load(weights_only=True)`).

meta.json carries a manifest: the size and the block hashes (trainer/integrity.py) of every file, taken
by the rank that wrote the file while writing it, so a file truncated or altered after the save is found
before it is loaded. Verifying splits the blocks evenly over the ranks. A checkpoint saved with
`pending_validation` is *good* only once `validated.json` exists (ModelCheckpoint writes it after
reloading the checkpoint and comparing losses); one that failed validation is renamed
`bad-step-XXXXXXXX` and kept for inspection.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from trainer import integrity

FORMAT_VERSION = 1  # the file layout; manifest entries: block hashes ({...}) or, before, [bytes, sha256]
META_FILE = "meta.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.pt"
DCP_DIR = "dcp"  # a sharded checkpoint's torch.distributed.checkpoint files, each rank's own
VALIDATED_FILE = "validated.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
log = logging.getLogger("trainer")

Entries = dict[str, Any]  # {path relative to the checkpoint: manifest entry}, as HashingFile.entry() gives
Agree = Callable[[Any], Any]  # this rank's problem (or None) -> the first of every rank's, on every rank


def alone(problem: str | None) -> str | None:
    """The `Agree` of a single process."""
    return problem


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit the model; `reason` says why
    without the checkpoint's path."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def meta_for(state: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """meta.json fields of a checkpoint of the trainer `state` (Trainer.save_checkpoint's, which always has
    "loop" and "meta"): its step and what the Trainer asked to record."""
    return {"step": state["loop"]["global_step"], **state["meta"], **extra}


def write_atomically(
    final_dir: Path,
    write: Callable[[Path], Entries],
    meta: dict[str, Any],
    staged: Path | None = None,
    written: Entries | None = None,
) -> Path:
    """Run `write(tmp_dir)` (it returns the manifest entries of what it wrote), add meta.json, then rename
    tmp_dir to `final_dir` (replacing an older one). `staged`: a temporary directory other writers (every
    rank's shards) already filled; `written`: the manifest entries of their files."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = staged or final_dir.parent / f".tmp-{final_dir.name}-{os.getpid()}"
    if staged is None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    entries = {**(written or {}), **write(tmp)}
    on_disk = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()}
    if on_disk != set(entries):  # a writer that bypassed the hashing: its files could never be verified
        raise CheckpointError(
            f"checkpoint {final_dir.name}: files without a hash {sorted(on_disk - set(entries))}, "
            f"hashes without a file {sorted(set(entries) - on_disk)}"
        )
    meta = {"format": FORMAT_VERSION, "time": time.time(), **meta}
    meta["files"] = sorted(p.name for p in tmp.iterdir())
    meta["manifest"] = dict(sorted(entries.items()))
    _write_synced(tmp / META_FILE, json.dumps(meta, indent=1).encode())
    old = final_dir.parent / f".old-{final_dir.name}-{os.getpid()}"
    if final_dir.exists():
        os.rename(final_dir, old)
    os.rename(tmp, final_dir)
    shutil.rmtree(old, ignore_errors=True)
    _fsync(final_dir.parent)
    return final_dir


_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def save_model_file(state_dict: dict[str, torch.Tensor], path: Path) -> Entries:
    """Write tensors as safetensors, streamed through the hash one tensor at a time (no whole-file buffer);
    tensors sharing memory (tied weights) are stored once, as aliases. Returns the file's manifest entry."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"state_dict entry {name!r} is a {type(value).__name__}; only tensors can be saved"
            )
        if value.dtype not in _ST_DTYPES:
            raise CheckpointError(
                f"state_dict entry {name!r} has dtype {value.dtype}; allowed: {', '.join(map(str, _ST_DTYPES))}"
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
        tensors[name] = value.detach()
    header: dict[str, Any] = {"__metadata__": {"aliases": json.dumps(aliases)}}
    offset = 0
    for name, t in tensors.items():
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the tensor data starts 8-byte aligned
    with integrity.HashingFile(path) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():  # one tensor at a time; copied only when not contiguous or not on the CPU
            f.write(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return {path.name: f.entry()}


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


def save_torch_file(obj: Any, path: Path) -> Entries:
    """`torch.save`, hashed while written; returns the file's manifest entry."""
    path = Path(path)
    with integrity.HashingFile(path) as f:
        torch.save(obj, f)
    return {path.name: f.entry()}


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


def problem(ckpt_dir: Path, part: tuple[int, int] = (0, 1), validated: bool = True) -> str | None:
    """Why the checkpoint is not good, as rank `part[0]` of `part[1]` sees it, or None. Every rank checks
    meta.json, each file's presence and size, and (with `validated`) the validation marker; the block
    hashes are split over the ranks (integrity.share), so the ranks' answers must be combined (`Agree`)."""
    try:
        meta = read_meta(ckpt_dir)
    except CheckpointError as err:
        return err.reason
    manifest = meta.get("manifest", {})
    for name, entry in manifest.items():
        path = Path(ckpt_dir) / name
        if not path.is_file():
            return f"incomplete: missing {name}"
        actual, size = path.stat().st_size, integrity.expected_size(entry)
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written (truncated or altered)"
    mismatch = integrity.first_mismatch(ckpt_dir, integrity.share(integrity.units(manifest), *part))
    if mismatch is not None:
        return mismatch
    if validated and meta.get("pending_validation") and not (Path(ckpt_dir) / VALIDATED_FILE).exists():
        return "never validated (the run stopped during validation?)"
    return None


def check_good(ckpt_dir: Path, part: tuple[int, int] = (0, 1), agree: Agree = alone) -> dict[str, Any]:
    """meta.json of a checkpoint that is complete, intact and, if it awaited validation, validated; else
    CheckpointError "checkpoint '<dir>': <why>". In a distributed run call it on every rank, with `agree`."""
    require_exists(ckpt_dir)
    why = agree(problem(ckpt_dir, part))
    if why is not None:
        raise CheckpointError(f"checkpoint '{ckpt_dir}': {why}", reason=why)
    return read_meta(ckpt_dir)


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


def require_exists(ckpt_dir: Path) -> None:
    """FileNotFoundError naming what is allowed, unless the user's `ckpt_dir` exists."""
    if not Path(ckpt_dir).exists():
        raise FileNotFoundError(
            f"checkpoint path '{ckpt_dir}' does not exist; allowed: an existing checkpoint directory, 'last' or None"
        )


def read_meta(ckpt_dir: Path) -> dict[str, Any]:
    """meta.json of a checkpoint; its absence means the directory was never completed."""
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
    except json.JSONDecodeError as err:
        why = f"{META_FILE} corrupted ({err})"
        raise CheckpointError(
            f"checkpoint '{ckpt_dir}' has a corrupted {META_FILE} ({err})", reason=why
        ) from err
    missing = [name for name in meta.get("files", []) if not (ckpt_dir / name).exists()]
    if missing:
        why = f"incomplete: missing {', '.join(missing)}"
        raise CheckpointError(f"checkpoint '{ckpt_dir}' is {why}", reason=why)
    return meta


def manifest_bytes(ckpt_dir: Path | None) -> int:
    """The bytes a checkpoint's manifest lists (0 for None or an unreadable checkpoint)."""
    try:
        manifest = read_meta(ckpt_dir)["manifest"] if ckpt_dir is not None else {}
    except (CheckpointError, FileNotFoundError, KeyError):
        return 0
    return sum(integrity.expected_size(entry) for entry in manifest.values())


def find_last(directory: Path) -> Path | None:
    """The completed checkpoint with the highest step under `directory`, or None (nothing is verified)."""
    done = _completed(directory)
    return done[0] if done else None


def find_last_good(
    directory: Path,
    before_step: int | None = None,
    part: tuple[int, int] = (0, 1),
    agree: Agree = alone,
) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint under `directory`, of a step < `before_step`, that is good, or None; one line
    "step-00000004: optimizer.pt checksum mismatch ..." per newer checkpoint it skipped). In a distributed
    run call it on every rank with `part` and `agree`: the hashing is split over the ranks."""
    skipped = []
    for path in _completed(directory):
        if before_step is not None and int(_STEP_DIR.match(path.name).group(1)) >= before_step:
            continue
        why = agree(problem(path, part))
        if why is None:
            return path, skipped
        skipped.append(f"{path.name}: {why}")
    return None, skipped


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
