"""Checkpoint files: atomic directories of safetensors weights + `weights_only` torch files, and finding "last".

A checkpoint is a directory `step-00000120/` holding `model.safetensors`, `optimizer.pt`, `state.pt`
(loop counters, RNG, scheduler, scaler, data position, callback state) and `meta.json`; a sharded one
holds each rank's own shards under `dcp/` instead of the first two. It is written under a temporary name
that carries its owner (`.tmp-step-N-<run id>-<pid>`) and renamed into place, so a directory with the
final name is always complete; a failed save removes its temporary directory, and a fit removes the ones
dead writers left in its folder (trainer/run_folder.py keeps one live writer per folder). A checkpoint
written by another run is never replaced.

What loading protects against:
- corruption (a flipped bit, a truncated or half-copied file, a deleted file): meta.json carries a
  manifest, the size and block hashes (trainer/integrity.py) of every file, taken while writing; every
  file is verified before it is loaded. A checkpoint without a manifest, or whose manifest lists no
  file, is refused unless the caller opts in (`allow_unverified`); meta.json's step must equal the
  loop state's inside the hashed files.
- code in a file: nothing is unpickled beyond an allow-list (safetensors; `torch.load(weights_only=True)`;
  DCP's metadata through an allow-listed unpickler and its byte items with `weights_only`), so a forged
  file is refused, naming it, instead of running.
What it does not protect against: an adversary who rewrites a file *and* its manifest entry can change
the weights or the loop state undetected (the hashes are for integrity, not authenticity).

A checkpoint saved with `pending_validation` is *good* only once `validated.json` exists (ModelCheckpoint
writes it after reloading the checkpoint and comparing losses); one that failed validation is renamed
`bad-step-XXXXXXXX` and kept for inspection.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
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
_STAGING = re.compile(r"^\.(tmp|old)-(step-\d+)")  # .tmp-step-N-<owner>: being written; .old-: being replaced
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


def staging_dir(final_dir: Path, meta: dict[str, Any], kind: str = "tmp") -> Path:
    """Where `final_dir` is written before it is renamed into place (`kind` "old": where the checkpoint it
    replaces waits): named for its owner, the run id and the writing process (rank zero's) in `meta`."""
    final_dir = Path(final_dir)
    owner = f"{meta.get('run_id', 'norun')}-{meta.get('writer', {}).get('pid', os.getpid())}"
    return final_dir.parent / f".{kind}-{final_dir.name}-{owner}"


def write_atomically(
    final_dir: Path,
    write: Callable[[Path], Entries],
    meta: dict[str, Any],
    staged: Path | None = None,
    written: Entries | None = None,
) -> Path:
    """Run `write(tmp_dir)` (it returns the manifest entries of what it wrote), add meta.json, then rename
    tmp_dir to `final_dir` (replacing an older one of the same run only). `staged`: a temporary directory
    other writers (every rank's shards) already filled; `written`: the manifest entries of their files.
    A failure removes the temporary directory; a full disk is a one-line CheckpointError."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    refuse_foreign(final_dir, meta)
    tmp = staged or staging_dir(final_dir, meta)
    try:
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
    except BaseException as err:
        reached = dir_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        said = save_error(err, final_dir, reached)
        if said is err:
            raise
        raise said from err
    old = staging_dir(final_dir, meta, "old")
    if final_dir.exists():
        os.rename(final_dir, old)
    os.rename(tmp, final_dir)
    shutil.rmtree(old, ignore_errors=True)
    _fsync(final_dir.parent)
    return final_dir


def refuse_foreign(final_dir: Path, meta: dict[str, Any]) -> None:
    """CheckpointError unless `final_dir` is free or a checkpoint of the run in `meta` (which it may replace)."""
    if not Path(final_dir).exists():
        return
    try:
        owner = read_meta(final_dir).get("run_id")
    except CheckpointError:
        owner = None  # an unreadable directory is nobody's to replace either
    if owner is None or owner != meta.get("run_id"):
        raise CheckpointError(
            f"checkpoint {final_dir} already exists and was written by "
            f"{'run ' + owner if owner else 'another run'}; it is not replaced: save under another path"
        )


def clear_stale_staging(folder: Path, keep: str | None = None) -> list[str]:
    """Remove what dead writers left in `folder` (call while holding its lock: no other writer is alive):
    temporary directories, and replaced checkpoints; one whose new version never arrived is put back.
    `keep`: a name prefix of this process's own. Returns one line per thing done."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    done = []
    for path in sorted(folder.iterdir()):
        m = _STAGING.match(path.name)
        if m is None or (keep is not None and path.name.startswith(keep)):
            continue
        final = folder / m.group(2)
        if m.group(1) == "old" and not final.exists():  # the writer died between the two renames
            os.rename(path, final)
            done.append(f"put back {final.name}, which a dead writer had moved aside")
            continue
        size = dir_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        done.append(f"removed {path.name} ({size / 2**20:.1f} MiB), left by a save that never finished")
    return done


def dir_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


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


def no_space(err: BaseException) -> bool:
    """Whether `err`, its causes, or any rank's failure in it (DCP) is a full disk (ENOSPC)."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return False


def save_error(err: BaseException, final_dir: Path, reached: int = 0) -> BaseException:
    """`err` as the user should see it: a full disk becomes one line naming the folder, the bytes needed
    (the previous checkpoint's size, else more than the `reached` bytes written before it failed) and
    free, and the previous checkpoint (untouched: a save only renames into place once complete)."""
    if not no_space(err) or isinstance(err, CheckpointError):
        return err
    final_dir = Path(final_dir)
    before = [p for p in completed(final_dir.parent) if p.name < final_dir.name]
    previous = manifest_bytes(before[0]) if before else 0
    needed = f"about {_mib(previous)}" if previous > reached else f"more than {_mib(reached)}"
    free = shutil.disk_usage(final_dir.parent).free
    kept = (
        f"the previous checkpoint {before[0].name} is intact" if before else "there is no earlier checkpoint"
    )
    return CheckpointError(
        f"checkpoint {final_dir.name} could not be written to {final_dir.parent}: no space left on device "
        f"(needs {needed}, {_mib(free)} free); {kept}",
        reason="no space left on device",
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


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
        try:
            torch.save(obj, f)
        except Exception as err:
            f.raise_write_error(err)
    return {path.name: f.entry()}


def load_torch_file(path: Path) -> Any:
    """`torch.load` that never runs code from the file and says which file is broken."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete") from err
    except pickle.UnpicklingError as err:  # weights_only refused a global: loading it could run code
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f"the global {found.group(1)}" if found else "an object outside the allow-list"
        raise CheckpointError(
            f"checkpoint file {path} is refused: it holds {what}, which only an unrestricted unpickler "
            "would load (and could run code); allowed: tensors and plain Python values",
            reason="refused: holds objects outside the allow-list",
        ) from err
    except Exception as err:  # torch raises RuntimeError/EOFError for damaged files
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint file {path} is unreadable, truncated or corrupted ({first})"
        ) from err


def problem(
    ckpt_dir: Path, part: tuple[int, int] = (0, 1), validated: bool = True, allow_unverified: bool = False
) -> str | None:
    """Why the checkpoint is not good, as rank `part[0]` of `part[1]` sees it, or None. Every rank checks
    meta.json, each file's presence and size, and (with `validated`) the validation marker; the block
    hashes are split over the ranks (integrity.share), so the ranks' answers must be combined (`Agree`).
    A checkpoint whose manifest is missing or lists no file is refused unless `allow_unverified`."""
    try:
        meta = read_meta(ckpt_dir)
    except CheckpointError as err:
        return err.reason
    manifest = meta.get("manifest") or {}
    if not manifest and not allow_unverified:
        return (
            f"{META_FILE} {'lists no file' if 'manifest' in meta else 'has no manifest'}, so nothing in it "
            "can be verified; refused (allow_unverified_checkpoints=True loads it unverified)"
        )
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


def check_good(
    ckpt_dir: Path, part: tuple[int, int] = (0, 1), agree: Agree = alone, allow_unverified: bool = False
) -> dict[str, Any]:
    """meta.json of a checkpoint that is complete, intact and, if it awaited validation, validated; else
    CheckpointError "checkpoint '<dir>': <why>". In a distributed run call it on every rank, with `agree`."""
    require_exists(ckpt_dir)
    why = agree(problem(ckpt_dir, part, allow_unverified=allow_unverified))
    if why is not None:
        raise CheckpointError(f"checkpoint '{ckpt_dir}': {why}", reason=why)
    meta = read_meta(ckpt_dir)
    if not meta.get("manifest"):
        log.warning(
            f"checkpoint '{ckpt_dir}' has no manifest: loaded unverified (allow_unverified_checkpoints)"
        )
    return meta


def check_step(ckpt_dir: Path, state: dict[str, Any]) -> None:
    """CheckpointError unless meta.json's step (not hashed) equals the loop state's (inside hashed files)."""
    said, inside = read_meta(ckpt_dir).get("step"), state.get("loop", {}).get("global_step")
    if said != inside:
        why = f"{META_FILE} says step {said} but its loop state is at step {inside} (meta.json was altered)"
        raise CheckpointError(f"checkpoint '{ckpt_dir}': {why}", reason=why)


def run_of(ckpt_dir: Path | None) -> str | None:
    """The id of the run that wrote a checkpoint (None: unreadable, or written before runs had ids)."""
    try:
        return read_meta(ckpt_dir).get("run_id") if ckpt_dir is not None else None
    except (CheckpointError, FileNotFoundError):
        return None


def mark_validated(ckpt_dir: Path, report: dict[str, Any]) -> None:
    """Record that the checkpoint passed validation (atomically: the file is complete or absent)."""
    tmp = Path(ckpt_dir) / f".{VALIDATED_FILE}.tmp"
    try:
        _write_synced(tmp, json.dumps(report, indent=1).encode())
    except OSError as err:  # the checkpoint stays unvalidated: "last" passes over it to the previous one
        tmp.unlink(missing_ok=True)
        said = save_error(err, Path(ckpt_dir))
        raise said if said is not err else CheckpointError(f"checkpoint {ckpt_dir}: {err}") from err
    os.rename(tmp, Path(ckpt_dir) / VALIDATED_FILE)
    _fsync(Path(ckpt_dir))


def mark_bad(ckpt_dir: Path) -> Path:
    """Move a checkpoint that failed validation out of the way of "last" (kept, for inspection)."""
    return move_aside(ckpt_dir, "bad")


def move_aside(ckpt_dir: Path, prefix: str) -> Path:
    """Rename a checkpoint to `<prefix>-step-N` (`.2`, `.3`... when taken: nothing set aside is deleted)."""
    ckpt_dir = Path(ckpt_dir)
    target, n = ckpt_dir.with_name(f"{prefix}-{ckpt_dir.name}"), 1
    while target.exists():
        n += 1
        target = ckpt_dir.with_name(f"{prefix}-{ckpt_dir.name}.{n}")
    os.rename(ckpt_dir, target)
    _fsync(ckpt_dir.parent)
    return target


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
    done = completed(directory)
    return done[0] if done else None


def find_last_good(
    directory: Path,
    before_step: int | None = None,
    part: tuple[int, int] = (0, 1),
    agree: Agree = alone,
    allow_unverified: bool = False,
) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint under `directory`, of a step < `before_step`, that is good, or None; one line
    "step-00000004: optimizer.pt checksum mismatch ..." per newer checkpoint it skipped). In a distributed
    run call it on every rank with `part` and `agree`: the hashing is split over the ranks."""
    skipped = []
    for path in completed(directory):
        if before_step is not None and int(_STEP_DIR.match(path.name).group(1)) >= before_step:
            continue
        why = agree(problem(path, part, allow_unverified=allow_unverified))
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


def completed(directory: Path) -> list[Path]:
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
