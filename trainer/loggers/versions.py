"""Versioned run folders for loggers, as Lightning's: `<save_dir>/<name>/version_N`, N the next free one,
or the `version` given (an int N, or a folder name). The ownership rules of trainer/checkpoint/run_folder.py
hold here too, with its lock (passed in with the `LoggerRun`, not imported): a live fit locks its folder (a
second fit asking for it is refused in one line); a fresh run never writes into a folder another run wrote
(the next free N; a given version that holds another run's logs is refused); a resumed run continues in the
folder its run id is recorded in (`.run_id`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainer.core.logging import log
from trainer.core.version_folders import versions
from trainer.loggers.base import Logger, LoggerRun

RUN_FILE = ".run_id"  # the run id of the fit that writes the folder: who owns its logs


class VersionedLogger(Logger):
    """A logger writing into `<save_dir>/<name>/version_N`; `save_dir` None: the Trainer's
    `default_root_dir`. `continues` says, after setup, whether this fit extends the folder's logs."""

    _SHARED = ("_save_dir", "_version")

    def __init__(self, save_dir: str | Path | None, name: str | None, version: int | str | None) -> None:
        if version is not None and not (isinstance(version, str) or _is_count(version)):
            raise ValueError(
                f"{type(self).__name__} version={version!r} is invalid; allowed: None (the next free "
                "version_N), an int >= 0 or a folder name"
            )
        self._save_dir = None if save_dir is None else os.fspath(save_dir)
        self._name = name or ""
        self._given = self._version = version
        self._lock: Any = None  # the folder's lock while this fit holds it (`release()`)
        self.continues = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    @property
    def root_dir(self) -> str | None:
        """`<save_dir>/<name>`: where the versions are (None before a fit when `save_dir` was not given)."""
        return None if self._save_dir is None else os.path.join(self._save_dir, self._name)

    @property
    def version(self) -> int | str | None:
        """The version given, the one this fit took, or (before a fit) the next free one, as in Lightning."""
        if self._version is None and self.root_dir is not None:
            self._version = next_version(Path(self.root_dir))
        return self._version

    @property
    def log_dir(self) -> str | None:
        version = self.version
        if version is None:
            return None
        return os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")

    def claim(self, run: LoggerRun) -> Path:
        """Choose, lock and mark this fit's folder (rank zero); returns it."""
        if self._save_dir is None:
            self._save_dir = os.fspath(run.root_dir)
        root, self.continues = Path(self.root_dir), False
        if self._given is None:
            self._version = self._claim_next(root, run)
        else:
            self._version = self._given
            self._claim_given(Path(self.log_dir), run)
        (Path(self.log_dir) / RUN_FILE).write_text(run.run_id)
        return Path(self.log_dir)

    def release(self) -> None:
        """Free the folder for the next fit (at fit end)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _claim_next(self, root: Path, run: LoggerRun) -> int:
        """The newest version when this fit resumes the run recorded there, else the next free one."""
        taken = [n for n, _ in versions(root)[1:]]
        if run.resume_step is not None and taken and owner(root / f"version_{taken[-1]}") == run.run_id:
            self._claim_given(root / f"version_{taken[-1]}", run)
            return taken[-1]
        n = taken[-1] + 1 if taken else 0
        while True:  # a fit starting at the same moment may take N first: then N + 1
            folder = root / f"version_{n}"
            try:
                self._lock = self._acquire(folder, run)
            except run.folder_locks.FolderInUse:
                n += 1
                continue
            if not _logged_in(folder, run):
                return n
            self.release()  # written by a fit that has ended since we looked
            n += 1

    def _claim_given(self, folder: Path, run: LoggerRun) -> None:
        self._lock = self._acquire(folder, run)
        earlier = owner(folder)
        if earlier == run.run_id:
            self.continues = run.resume_step is not None
        elif _logged_in(folder, run):
            self.release()
            raise ValueError(
                f"{type(self).__name__}(version={self._given!r}): {folder} holds the logs of another run "
                f"({earlier or 'unknown'}), kept untouched; allowed: version=None (the next free version_N) "
                "or a version no other run has written"
            )

    def _acquire(self, folder: Path, run: LoggerRun) -> Any:
        locks = run.folder_locks
        try:
            lock, note = locks.acquire(folder, run.run_id)
        except locks.FolderInUse:
            holder = locks.describe(locks.held_by(folder))
            raise locks.FolderInUse(
                f"{type(self).__name__} folder {folder} is in use by {holder}; a second live fit cannot "
                "write there: allowed: version=None (the next free version_N), or another save_dir or name"
            ) from None
        if note:
            log.warning(note)
        return lock


def next_version(root: Path) -> int:
    """One more than the highest `version_N` under `root` (0 when there is none), as Lightning counts."""
    taken = [n for n, _ in versions(root)[1:]]
    return taken[-1] + 1 if taken else 0


def owner(folder: Path) -> str | None:
    """The run id recorded in a logger folder, or None."""
    try:
        return (Path(folder) / RUN_FILE).read_text().strip() or None
    except OSError:
        return None


def _logged_in(folder: Path, run: LoggerRun) -> bool:
    """Whether a run has written logs into `folder` (anything beyond the lock and the run marker)."""
    own = {RUN_FILE, run.folder_locks.LOCK_FILE}  # what a folder no run has logged into yet may hold
    return Path(folder).is_dir() and any(p.name not in own for p in Path(folder).iterdir())


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
