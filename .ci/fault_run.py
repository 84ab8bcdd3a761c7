"""The fault audit's machinery (see fault_audit.py): what a case is, running one command as a user would
(its own process group, a timeout, signals sent on cue, a file-size limit, chmod that binds root) and the
real runs cases start from, made once and copied per case."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"
PY, TRAINER = str(BIN / "python"), str(BIN / "trainer")
MARKER = "MARKER"  # what a crafted pickle creates in the case folder when it runs
NO_DAC = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]  # root then obeys chmod
LAUNCHER_KEYS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"}  # fmt: skip
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PROGRESS = re.compile(r"^(\[[^]]+\] )?[\w/ ]+:\s+\d+%\|")  # a tqdm bar's redraw: "train:  50%|###   | 3/6"


@dataclass
class Command:
    """What a case runs, in its folder: argv, its timeout, and how it is disturbed while it runs."""

    argv: list[str]
    timeout: float = 120.0
    fsize: int | None = None  # RLIMIT_FSIZE in bytes: a write past it fails with EFBIG
    no_dac: bool = False  # root without CAP_DAC_OVERRIDE/READ_SEARCH: chmod binds (the audit runs as root)
    # (where, regex, signal): sent to the process group once `where` (output, or a file) matches, in order
    signals: tuple[tuple[str, str, int], ...] = ()


Check = Callable[[Path, str], "str | None"]  # (case folder, last line) -> what does not hold, if anything


@dataclass(frozen=True)
class Case:
    """One audit case: `prepare(folder)` sets the folder up and returns the command; `expect` is one of
    ok (good input: exit 0), refuse (exit != 0 naming it), recover (exit 0 with a warning naming it),
    notice (either of the two), answer (exit 0, or a refusal naming it), signal (exit `code`)."""

    name: str
    what: str
    prepare: Callable[[Path], Command]
    expect: str
    names: str = r"."  # regex: what the last line (refusal) or a warning line (exit 0) must name
    code: int | None = None  # the exit code a signal case needs
    check: Check | None = None
    api: bool = False  # the user's script: Python prints its own traceback of an uncaught exception
    owned: tuple[str, ...] = ("run/logs/", "run/export/", "out/", "run/checkpoints/.lock")  # the run's own


@dataclass
class Result:
    """What one command did, and the audit's verdict on it."""

    rc: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    last: str = ""
    warning: str = ""  # the first line naming the problem, when there is one
    verdict: str = ""
    why: str = ""
    folder: Path = field(default_factory=Path)


def trainer_cmd(*args: str, **kw) -> Command:
    """`trainer ARGS` as the user types it."""
    return Command([TRAINER, *args], **kw)


def child_env(home: Path, cache: Path) -> dict[str, str]:
    """Offline, one thread per process, no launcher variables, the audit's own token cache, unbuffered (the
    output comes as a terminal shows it)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    extra = {"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRAINER_CACHE": str(cache),
             "HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    return {**env, **extra}


def preexec(cmd: Command) -> Callable[[], None]:
    def setup() -> None:
        import resource

        signal.signal(
            signal.SIGINT, signal.SIG_DFL
        )  # as a terminal's job: a shell's `&` would leave it ignored
        if cmd.fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a core dump
            resource.setrlimit(resource.RLIMIT_FSIZE, (cmd.fsize, cmd.fsize))

    return setup


def execute(cmd: Command, cwd: Path, env: dict[str, str]) -> Result:
    """Run `cmd` in its own process group, reading its output as it comes (to send `signals` on cue); past
    the timeout the group is killed."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [*NO_DAC, *cmd.argv] if cmd.no_dac else cmd.argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec(cmd),
    )  # fmt: skip
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}
    news = threading.Event()

    def pump(stream, key: str) -> None:
        while data := os.read(stream.fileno(), 65536):
            chunks[key].append(data)
            news.set()

    streams = ((proc.stdout, "out"), (proc.stderr, "err"))
    readers = [threading.Thread(target=pump, args=(s, k), daemon=True) for s, k in streams]
    for t in readers:
        t.start()
    pending, timed_out = list(cmd.signals), False
    while proc.poll() is None:
        left = cmd.timeout - (time.monotonic() - start)
        if left <= 0:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            break
        news.wait(min(left, 0.5))
        news.clear()
        while pending and re.search(pending[0][1], seen(pending[0][0], cwd, chunks)):
            os.killpg(proc.pid, pending.pop(0)[2])
    proc.wait()
    for t in readers:
        t.join(timeout=5)
    rc = None if timed_out else proc.returncode
    return Result(rc, text(chunks["out"]), text(chunks["err"]), timed_out, time.monotonic() - start)


def seen(where: str, cwd: Path, chunks: dict[str, list[bytes]]) -> str:
    """The command's output so far, or the file `where` (relative to its folder) as it is now."""
    if where == "output":
        return text(chunks["out"] + chunks["err"])
    path = cwd / where
    return path.read_text(errors="replace") if path.is_file() else ""


def text(chunks: list[bytes]) -> str:
    return ANSI.sub("", b"".join(chunks).decode("utf-8", "replace"))


def lines(output: str) -> list[str]:
    """The lines a terminal shows, but the progress bar's redraws (\\r) and bare "[replica I]" prefixes."""
    shown = [s.strip() for s in re.split(r"[\r\n]", output)]
    return [s for s in shown if s and not PROGRESS.match(s) and not re.fullmatch(r"\[[^]]+\]", s)]


def last_line(result: Result) -> str:
    """The last line the user saw: stderr's last non-empty one (stdout's when stderr is empty)."""
    return (lines(result.stderr) or lines(result.stdout) or [""])[-1]


class Fixtures:
    """The runs cases start from, each built by `builds[name](folder)`'s commands on first use (one at a
    time) under the audit's work folder, then copied into a case's folder."""

    def __init__(self, work: Path, builds: dict[str, Callable[[Path], list[Command]]]) -> None:
        self.work, self.cache, self.builds = work, work / "cache", builds
        self.cache.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._built: dict[str, Path] = {}

    def env(self, home: Path) -> dict[str, str]:
        return child_env(home, self.cache)

    def get(self, name: str) -> Path:
        with self._lock:
            if name not in self._built:
                folder = self.work / "fixtures" / name
                folder.mkdir(parents=True)
                for cmd in self.builds[name](folder):
                    r = execute(cmd, folder, self.env(folder))
                    if r.rc != 0:
                        raise RuntimeError(f"fixture {name} failed ({r.rc}): {last_line(r)}")
                self._built[name] = folder
            return self._built[name]

    def copy(self, name: str, into: Path) -> None:
        shutil.copytree(self.get(name), into, dirs_exist_ok=True, symlinks=True)


_fixtures: list[Fixtures] = []  # the audit's one instance (use_fixtures)


def use_fixtures(fixtures: Fixtures) -> None:
    _fixtures[:] = [fixtures]


def fixtures() -> Fixtures:
    """The audit's fixtures (set by its main)."""
    return _fixtures[0]
