"""Writing a checkpoint so that it is complete or absent: the staging directory and rename protocol.

A checkpoint is written under a temporary name that carries its owner (`.tmp-step-N-<run id>-<pid>`)
and renamed into place, so a directory with the final name is always complete; a failed save removes its
temporary directory, and a fit removes the ones dead writers left in its folder (trainer/checkpoint/run_folder.py
keeps one live writer per folder). A checkpoint written by another run is never replaced. A full disk is
one line naming the bytes needed and free. Checkpoints that failed validation, or that a restore made a
discarded future, are renamed aside (`bad-step-...`, `discarded-step-...`), never deleted.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint.layout import (
    FORMAT_VERSION,
    META_FILE,
    VALIDATED_FILE,
    CheckpointError,
    Entries,
    completed,
    manifest_bytes,
    read_meta,
)

# .tmp-<name>-<run id>-<pid>: being written; .old-...: being replaced (a run id and a pid hold no "-")
_STAGING = re.compile(r"^\.(tmp|old)-(step-\d+|.+(?=-[^-]+-\d+$))")


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
    try:
        _rename_into_place(tmp, final_dir, old)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists():
            kept = f"the checkpoint it was to replace waits as {old.name} (the next fit puts it back)"
        else:
            kept = (
                "the checkpoint it was to replace is intact" if final_dir.exists() else "nothing was replaced"
            )
        raise CheckpointError(
            f"checkpoint {final_dir.name} could not be renamed into place in {final_dir.parent} "
            f"({err.strerror or err}); {kept}"
        ) from err
    _fsync(final_dir.parent)
    return final_dir


def _rename_into_place(tmp: Path, final_dir: Path, old: Path) -> None:
    """Rename `tmp` to `final_dir`. A checkpoint already there is never deleted first: it waits as `old` and
    is deleted once the new one is in place, or renamed back when that fails (a crash in between leaves
    `old`, which the next fit's `clear_stale_staging` puts back)."""
    replacing = final_dir.exists()
    if replacing:
        os.rename(final_dir, old)
    try:
        os.rename(tmp, final_dir)
    except BaseException:
        if replacing:
            os.rename(old, final_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def refuse_foreign(final_dir: Path, meta: dict[str, Any]) -> None:
    """CheckpointError unless `final_dir` is free or a complete checkpoint of the run in `meta` (which it may
    replace): a directory whose owner cannot be read is nobody's to replace either."""
    if not Path(final_dir).exists() and not Path(final_dir).is_symlink():
        return
    try:
        owner = read_meta(final_dir).get("run_id")
    except (CheckpointError, OSError) as err:
        raise CheckpointError(
            f"{final_dir} already exists and is no checkpoint this run can replace "
            f"({getattr(err, 'reason', err)}); it is not replaced: move it away or save under another path"
        ) from err
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


# what the storage, not the program, says when a write fails: a full disk, a file-size limit, a quota, a
# read-only or failing file system, permissions
_STORAGE_ERRORS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM}


def write_failure(err: BaseException) -> OSError | None:
    """The storage's error in `err`, its causes, or any rank's failure in it (DCP), or None."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRORS:
            return e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


def no_space(err: BaseException) -> bool:
    """Whether `err`, its causes, or any rank's failure in it (DCP) is a full disk (ENOSPC)."""
    failure = write_failure(err)
    return failure is not None and failure.errno == errno.ENOSPC


def save_error(err: BaseException, final_dir: Path, reached: int = 0) -> BaseException:
    """`err` as the user should see it: the storage refusing the write becomes one line naming the folder
    and the previous checkpoint (untouched: a save only renames into place once complete); for a full disk
    also the bytes needed (the previous checkpoint's size, else more than the `reached` bytes written before
    it failed) and free."""
    failure = write_failure(err)
    if failure is None or isinstance(err, CheckpointError):
        return err
    final_dir = Path(final_dir)
    before = [p for p in completed(final_dir.parent) if p.name < final_dir.name]
    kept = (
        f"the previous checkpoint {before[0].name} is intact" if before else "there is no earlier checkpoint"
    )
    why = os.strerror(failure.errno).lower()
    if failure.errno != errno.ENOSPC:
        where = f" at {Path(failure.filename).name}" if failure.filename else ""
        return CheckpointError(
            f"checkpoint {final_dir.name} could not be written to {final_dir.parent}: {why}{where}; {kept}",
            reason=why,
        )
    previous = manifest_bytes(before[0]) if before else 0
    needed = f"about {_mib(previous)}" if previous > reached else f"more than {_mib(reached)}"
    free = shutil.disk_usage(final_dir.parent).free
    return CheckpointError(
        f"checkpoint {final_dir.name} could not be written to {final_dir.parent}: {why} "
        f"(needs {needed}, {_mib(free)} free); {kept}",
        reason=why,
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


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
