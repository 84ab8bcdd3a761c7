"""A run's checkpoint folder: which folder a fit writes to, and the lock that keeps it to one live writer.

A fit owns the folder it writes checkpoints into. The base folder (`<default_root_dir>/checkpoints`, or
ModelCheckpoint's dirpath) is used while it holds no checkpoint; a fresh fit into a base that already holds
another run's checkpoints writes into `<base>/version_N` (N one more than the highest there), so nothing of
the earlier run is touched. `ckpt_path="last"` resumes the newest of these folders, so the same command
continues the same run on every restart.

The lock is an advisory `flock` on `<folder>/.lock`, which also records its holder (host, pid, run id,
start time) for the message a second fit gets; the file is removed when the fit ends. The kernel releases a
flock when its process dies, so a crashed fit never leaves a live-looking lock behind (its file is taken
over, with a note), and a copied folder carries no lock at all. On a shared
file system the lock is as good as its `flock` support (NFSv4 and Lustre with `-o flock` honour it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.core.version_folders import versions

LOCK_FILE = ".lock"
# what a run leaves: kept, failed, discarded (a checkpoint a filename template names: any with a meta.json)
_CHECKPOINT = re.compile(r"^(bad-|discarded-)?step-\d+")


class FolderInUse(RuntimeError):
    """Another live fit writes into the folder a fit wanted."""


@dataclass
class FolderLock:
    """The lock of a run folder, held from fit start to fit end (`release`)."""

    folder: Path
    fd: int

    def release(self) -> None:
        """Remove the lock file, then drop the lock (a fit waiting to take it sees the file gone: retries)."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.folder / LOCK_FILE)
        os.close(self.fd)  # closing the only descriptor releases the flock
        self.fd = -1


def newest(base: Path) -> Path:
    """The folder of the newest run under `base`: the one `ckpt_path="last"` resumes."""
    return versions(base)[-1][1]


def holds_checkpoints(folder: Path) -> bool:
    """Whether `folder` has any checkpoint directory of a run (kept, failed or discarded)."""
    folder = Path(folder)
    from trainer import checkpoint as ckpt

    return folder.is_dir() and (
        any(_CHECKPOINT.match(p.name) and p.is_dir() for p in folder.iterdir())
        or bool(ckpt.completed(folder))
    )


def choose(base: Path, resume_last: bool, run_id: str | None = None) -> tuple[Path, str | None]:
    """(the folder a fit writes into, a one-line note when it is a new `version_N`). A run resumed with
    "last", or from a checkpoint of run `run_id` that the newest folder holds checkpoints of, continues in
    the newest folder; any other fit takes it only while it holds no checkpoint."""
    n, folder = versions(base)[-1]
    holder = held_by(folder)
    if holder is not None:  # a live fit writes there: a fresh run going elsewhere would hide a mistake
        raise FolderInUse(in_use(folder, holder))
    if resume_last or not holds_checkpoints(folder) or (run_id is not None and run_id in runs_in(folder)):
        return folder, None
    fresh = Path(base) / f"version_{n + 1}"
    return fresh, f"{folder} holds an earlier run's checkpoints (kept untouched); this run writes to {fresh}"


def runs_in(folder: Path) -> set[str]:
    """The run ids of the completed checkpoints in `folder`."""
    from trainer import checkpoint as ckpt

    return {run for path in ckpt.completed(folder) if (run := ckpt.run_of(path)) is not None}


def acquire(folder: Path, run_id: str) -> tuple[FolderLock, str | None]:
    """Take the lock of `folder` for this process (creating the folder); (the lock, a one-line note when an
    earlier holder's record was left behind). FolderInUse, naming the holder, when a live fit holds it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise FolderInUse(in_use(folder, holder)) from None
        if _same_file(fd, folder / LOCK_FILE):
            break
        os.close(fd)  # the holder removed this file as we locked it: lock the one there now
    earlier = _read(fd)
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "run_id": run_id,
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "folder": str(folder.resolve()),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)
    # a record naming another folder was copied along with the folder: nobody was taken over from
    taken_over = earlier is not None and earlier.get("folder") == record["folder"]
    note = f"took over the lock of {folder} from {describe(earlier)}, which is gone" if taken_over else None
    return FolderLock(folder, fd), note


def held_by(folder: Path) -> dict[str, Any] | None:
    """The record of the live fit that holds `folder`'s lock (`{}` if it wrote none yet), or None."""
    try:
        fd = os.open(Path(folder) / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd) or {}
    finally:
        os.close(fd)  # a shared lock we got is dropped with it
    return None


def in_use(folder: Path, holder: dict[str, Any] | None) -> str:
    """The one line a fit gets when a live fit holds the folder it wants."""
    return (
        f"checkpoint folder {folder} is in use by {describe(holder)}; a second live fit cannot write there: "
        "wait for it to end, or give this fit another default_root_dir or ModelCheckpoint(dirpath=...)"
    )


def describe(holder: dict[str, Any] | None) -> str:
    """'run 3f2a... (pid 812 on host a1, since 2026-12-01 10:00:00)' of a lock record."""
    if not holder:
        return "a fit that left no record"
    return (
        f"run {holder.get('run_id', '?')} (pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
        f"since {holder.get('since', '?')})"
    )


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read(fd: int) -> dict[str, Any] | None:
    raw = os.pread(fd, 1 << 16, 0)
    try:
        record = json.loads(raw) if raw.strip() else None
    except ValueError:
        return {"run_id": "?", "pid": "?", "host": "?", "since": "? (unreadable lock record)"}
    return record if isinstance(record, dict) else None


@dataclass
class Claim:
    """What rank zero decided at fit start, for every rank: each saver's folder, the run id, the writer."""

    folders: list[str]
    run_id: str
    writer: dict[str, Any]
    notes: list[str]


def claim(bases: list[Path], ckpt_path: Any, locks: list[FolderLock]) -> Claim:
    """On rank zero: choose and lock the folder of each base (appending the locks to `locks`), clear
    what dead writers left there, and pick the run id. A fit that continues a run in its folder ("last",
    or a checkpoint of the run whose checkpoints the folder holds) keeps that run's id, so the checkpoints
    it wrote before stay its own; any other fit is a new run."""
    from trainer import checkpoint as ckpt  # checkpoint files know nothing of folders; this is one level up

    resume_last = ckpt_path == "last"
    newest_first = newest(Path(bases[0])) if bases else None
    if resume_last:  # the run of the newest checkpoint that names one (a damaged meta.json names none)
        found = ckpt.completed(newest_first) if newest_first is not None else []
        resumed = next((run for path in found if (run := ckpt.run_of(path)) is not None), None)
    else:
        resumed = ckpt.run_of(Path(ckpt_path)) if ckpt_path is not None else None
    chosen: dict[Path, tuple[Path, str | None]] = {}
    for base in bases:  # two savers with one base share its folder (and its one lock)
        chosen.setdefault(Path(base), choose(Path(base), resume_last, resumed))
    first = next(iter(chosen.values()), (None, None))[0]
    continues = resumed is not None and first is not None and resumed in runs_in(first)
    run_id = resumed if continues else new_run_id()
    notes = []
    for folder, note in chosen.values():
        lock, took = acquire(folder, run_id)
        locks.append(lock)
        notes += [line for line in (note, took) if line]
        notes += [f"{folder}: {line}" for line in ckpt.clear_stale_staging(folder)]
    return Claim([str(chosen[Path(b)][0]) for b in bases], run_id, this_writer(), notes)


def this_writer() -> dict[str, Any]:
    """{"host", "pid"} of this process: who writes a run's files (rank zero, in a distributed run)."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def new_run_id() -> str:
    """A fresh run id: 12 hex digits, unique enough to tell runs apart in one folder."""
    return uuid.uuid4().hex[:12]
