"""Fault audit (issue 48; not in CI, not part of pytest): about 100 cases run as a user runs them (the
`trainer` CLI, a small Python script with the `Trainer` API, 2 DDP ranks), each in its own temp folder,
after something went wrong: a checkpoint file truncated, flipped, deleted, appended to, swapped, forged with
a pickle that runs code; malformed data; bad flags; a full disk; Ctrl-C and SIGTERM. Prints one row per
case (what was done, the exit code, the last line the user saw: stderr's last non-empty line) and totals.

    .venv/bin/python .ci/fault_audit.py [--only SUBSTR] [--jobs 1] [--keep]

Verdicts, first that applies:
  HANG      the command ran past its timeout (it is killed with its process group)
  CODE-RUN  a crafted pickle in a checkpoint ran: its marker file exists
  LOST      a file the folder held before the command (another run's checkpoint, the user's data) is gone or
            changed and its bytes are nowhere in the folder (a checkpoint set aside as discarded-... is kept)
  SILENT    bad input, exit 0 and no line naming the problem (the run went on as if nothing was wrong)
  WRONG     not the outcome the case needs: a good command failed, a resume that should go on failed, a
            signal's exit code or checkpoint missing
  UGLY      the right outcome, badly told: a traceback (a user script's own one-exception traceback is
            Python's), torch's weights_only advice, or a last line that does not name the file/key/flag
  ok        none of the above
Non-ok case folders are kept (their path is printed); the others are removed unless --keep.
"""

from __future__ import annotations

import argparse
import builtins
import functools
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"
PY, TRAINER = str(BIN / "python"), str(BIN / "trainer")
TINY, RECIPES = str(REPO / "recipes" / "llama_tiny.yaml"), REPO / "recipes"
SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "data.seq_len=64"]
EVERY_2 = "callbacks=[{class_path: callbacks.ModelCheckpoint, init_args: {every_n_steps: 2, save_top_k: -1}}]"
RUN = [*SMALL, "data.batch_size=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=2",
       "trainer.warmup_steps=1", "trainer.val_at_start=false", "trainer.default_root_dir=run", EVERY_2]  # fmt: skip
RESUME = ["fit", TINY, *RUN, "trainer.max_steps=8", "--ckpt-path", "last"]
VALIDATE = ["validate", TINY, *RUN]
STEP6, STEP4 = "run/checkpoints/step-00000006", "run/checkpoints/step-00000004"
EXPORT6 = ["export", STEP6, "out"]
MARKER = "MARKER"  # what a crafted pickle creates in the case folder when it runs
NO_DAC = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]  # root then obeys chmod
LAUNCHER_KEYS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"}  # fmt: skip
WARN_WORDS = re.compile(
    r"skip|discard|set aside|refus|mismatch|missing|corrupt|truncat|not listed|bad|invalid|damaged|cannot|"
    r"can't|fail|not a |unreadable|ignor|error|warn|unknown|no checkpoint|left out|not finite|non-finite",
    re.I,
)
UGLY_TEXT = re.compile(
    r"weights_only|metadata is None|During handling of the above|direct cause of the", re.I
)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PROGRESS = re.compile(r"^[\w/ ]+:\s+\d+%\|")  # a tqdm bar's redraw: "train:  50%|#####     | 3/6 ..."


@dataclass
class Command:
    """What a case runs, in its folder: argv, its timeout, and how it is disturbed while it runs."""

    argv: list[str]
    timeout: float = 120.0
    fsize: int | None = None  # RLIMIT_FSIZE in bytes: a write past it fails with EFBIG
    no_dac: bool = False  # root without CAP_DAC_OVERRIDE/READ_SEARCH: chmod binds (the audit runs as root)
    # (where, regex, signal): sent to the process group once `where` (output, or a file) matches, in order
    signals: tuple[tuple[str, str, int], ...] = ()


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
    check: Callable[[Path, str], str | None] | None = (
        None  # (folder, last line) -> what does not hold, if any
    )
    api: bool = False  # the user's script: Python prints its own traceback of an uncaught exception
    owned: tuple[str, ...] = ("run/logs/", "run/export/", "out/")  # what the run writes as its own output


@dataclass
class Result:
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


# --- running a command ---------------------------------------------------------------------------------------


def child_env(home: Path, cache: Path) -> dict[str, str]:
    """Offline, one thread per process, no launcher variables, the audit's own token cache."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    extra = {
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TRAINER_CACHE": str(cache),
    }
    return {
        **env,
        **extra,
        "HOME": str(home),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }  # as a terminal shows it


def preexec(cmd: Command) -> Callable[[], None]:
    def setup() -> None:
        import resource

        if cmd.fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a core dump
            resource.setrlimit(resource.RLIMIT_FSIZE, (cmd.fsize, cmd.fsize))

    return setup


def execute(cmd: Command, cwd: Path, env: dict[str, str]) -> Result:
    """Run `cmd` in its own process group, reading its output as it comes (to send `signals` on cue); past
    the timeout the group is killed."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [*NO_DAC, *cmd.argv] if cmd.no_dac else cmd.argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, preexec_fn=preexec(cmd),
    )  # fmt: skip
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}
    news = threading.Event()

    def pump(stream, key: str) -> None:
        while data := os.read(stream.fileno(), 65536):
            chunks[key].append(data)
            news.set()

    readers = [threading.Thread(target=pump, args=(s, k), daemon=True) for s, k in ((proc.stdout, "out"), (proc.stderr, "err"))]  # fmt: skip
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
    """The lines a terminal shows: progress bars redraw with \\r, so each redraw counts as a line."""
    return [s.strip() for s in re.split(r"[\r\n]", output) if s.strip() and not PROGRESS.match(s.strip())]


def last_line(result: Result) -> str:
    return (lines(result.stderr) or lines(result.stdout) or [""])[-1]


# --- the folder before and after ------------------------------------------------------------------------------


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(folder: Path, owned: tuple[str, ...]) -> dict[str, str]:
    """relative path -> sha256 of every file in `folder` but the run's own outputs."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and not path.is_symlink() and not rel.startswith(owned) and rel != MARKER:
            out[rel] = digest(path)
    return out


def lost_files(folder: Path, before: dict[str, str]) -> list[str]:
    """The files of `before` whose bytes are now nowhere in `folder`."""
    now = {digest(p) for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}
    return [rel for rel, h in before.items() if h not in now]


# --- the verdict ----------------------------------------------------------------------------------------------


def judge(case: Case, r: Result, folder: Path, lost: list[str]) -> tuple[str, str]:
    """(verdict, why) by the rules of the module docstring."""
    if r.timed_out:
        return "HANG", f"killed after {r.seconds:.0f} s"
    if (folder / MARKER).exists():
        return "CODE-RUN", "the crafted pickle's marker exists"
    if lost:
        return "LOST", ", ".join(lost[:4])
    all_lines = lines(r.stderr) + lines(r.stdout)
    warnings = [s for s in all_lines if re.search(case.names, s, re.I) and WARN_WORDS.search(s)]
    r.warning = warnings[0] if warnings and case.expect != "ok" else ""
    warned = bool(warnings)
    wrong = outcome(case, r.rc, warned)
    if wrong:
        return wrong
    if case.check and (problem := case.check(folder, last_line(r))):
        return "WRONG", problem
    return looks(case, r)


def outcome(case: Case, rc: int | None, warned: bool) -> tuple[str, str] | None:
    if case.expect == "ok" and rc != 0:
        return "WRONG", f"a good command exited {rc}"
    if case.expect in ("refuse", "notice") and rc == 0 and not warned:
        return "SILENT", "exit 0 and no line names the problem"
    if case.expect == "recover":
        if rc != 0:
            return "WRONG", f"exited {rc}: the run should go on past the bad checkpoint"
        if not warned:
            return "SILENT", "exit 0 and no line names the problem"
    if case.expect == "refuse" and rc == 0:
        return "WRONG", "warned but exited 0: should refuse"
    if case.expect == "signal" and rc != case.code:
        return "WRONG", f"exit {rc}, expected {case.code}"
    return None


def looks(case: Case, r: Result) -> tuple[str, str]:
    """UGLY or ok: how the outcome was told."""
    last = last_line(r)
    if "Traceback" in r.stderr and not case.api:
        return "UGLY", "a traceback"
    if UGLY_TEXT.search(r.stderr):
        return "UGLY", UGLY_TEXT.search(r.stderr).group(0)
    if r.rc != 0 and not re.search(case.names, last, re.I):
        return "UGLY", f"the last line does not name /{case.names}/"
    return "ok", ""


# --- fixtures: real runs, made once and copied per case ---------------------------------------------------------


class Fixtures:
    """The runs cases start from, built on first use (one at a time) under the audit's work folder."""

    def __init__(self, work: Path) -> None:
        self.work, self.cache = work, work / "cache"
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
                for cmd in BUILDS[name](folder):
                    r = execute(cmd, folder, self.env(folder))
                    if r.rc != 0:
                        raise RuntimeError(f"fixture {name} failed ({r.rc}): {last_line(r)}")
                self._built[name] = folder
            return self._built[name]

    def copy(self, name: str, into: Path) -> None:
        shutil.copytree(self.get(name), into, dirs_exist_ok=True, symlinks=True)


API_SCRIPT = '''"""A user's script: a small regressor, a checkpoint every 2 steps (the fault audit writes it)."""
import argparse, os, signal
import torch
from torch.utils.data import DataLoader, TensorDataset
from callbacks import ModelCheckpoint
from trainer import Trainer, TrainModule
from trainer.fault_tolerance import FaultTolerance

GROUP = os.environ.get("REPLICA_GROUP_ID")  # set by `trainer replicas`


class Regressor(TrainModule):
    def __init__(self, nan_from=None, signal_at=None, signal_name="SIGINT", exit_at=None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.nan_from, self.signal_at, self.signal_name = nan_from, signal_at, signal_name
        self.exit_at = exit_at

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        step = self.global_step + 1  # the optimizer step this batch makes
        if self.signal_at == step:
            os.kill(os.getpid(), getattr(signal, self.signal_name))
        if self.exit_at == step and GROUP == "1":
            os._exit(3)  # replica group 1 is lost
        if self.nan_from is not None and step >= self.nan_from:
            loss = loss * float("nan")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


p = argparse.ArgumentParser()
p.add_argument("--max-steps", type=int, default=6)
p.add_argument("--ckpt-path", default=None)
p.add_argument("--no-checkpointing", action="store_true")
p.add_argument("--nan-from", type=int)
p.add_argument("--signal-at", type=int)
p.add_argument("--signal", default="SIGINT")
p.add_argument("--exit-at", type=int, help="replica group 1 dies in this step")
p.add_argument("--fault-tolerance", action="store_true", help="a replica group of `trainer replicas`")
args = p.parse_args()
ft = FaultTolerance.from_env(timeout_s=5, quorum_timeout_s=10) if args.fault_tolerance else None
g = torch.Generator().manual_seed(0)
x = torch.randn(256, 8, generator=g)
y = torch.tanh(x @ torch.randn(8, 1, generator=g))
loader = DataLoader(TensorDataset(x, y), batch_size=16)
callbacks = [] if args.no_checkpointing else [ModelCheckpoint(every_n_steps=2, save_top_k=-1)]
root = f"run/replica{GROUP}" if ft else "run"
trainer = Trainer(max_steps=args.max_steps, default_root_dir=root, callbacks=callbacks, seed=0, fault_tolerance=ft,
                  enable_checkpointing=not args.no_checkpointing, enable_progress_bar=False)
module = Regressor(args.nan_from, args.signal_at, args.signal, args.exit_at)
trainer.fit(module, loader, loader, ckpt_path=args.ckpt_path)
print("fit returned")
'''


def api(*args: str, timeout: float = 120.0) -> Command:
    return Command([PY, "fit.py", *args], timeout=timeout)


def build_cli(folder: Path) -> list[Command]:
    return [trainer_cmd("fit", TINY, *RUN, "trainer.max_steps=6", timeout=300)]


def build_api(folder: Path) -> list[Command]:
    (folder / "fit.py").write_text(API_SCRIPT)
    return [api("--max-steps", "6", timeout=300)]


def build_ddp(folder: Path) -> list[Command]:
    return [trainer_cmd("fit", TINY, *RUN, *DDP, "trainer.max_steps=4", timeout=300)]


SFT = str(RECIPES / "hf_sft_llama_tiny.yaml")
LORA = [*"model.hf=new:base data.batch_size=4 trainer.val_check_interval=2 trainer.limit_val_batches=1".split(),
        "model.lora={r: 4, target_modules: [q_proj, v_proj]}", f"data.path={RECIPES / 'data' / 'sft_tiny.jsonl'}",
        "trainer.default_root_dir=run", "trainer.warmup_steps=1", EVERY_2]  # fmt: skip


def build_lora(folder: Path) -> list[Command]:
    """LoRA adapters on a new tiny HF Llama (saved at base/), checkpoints at steps 2 and 4."""
    return [trainer_cmd("fit", SFT, *LORA, "trainer.max_steps=4", timeout=300)]


BUILDS: dict[str, Callable[[Path], list[Command]]] = {
    "cli": build_cli, "api": build_api, "ddp": build_ddp, "lora": build_lora,
}  # fmt: skip


def trainer_cmd(*args: str, **kw) -> Command:
    return Command([TRAINER, *args], **kw)


# --- damage -----------------------------------------------------------------------------------------------------


class Shell:
    """A pickle payload: unpickling it runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class Exec:
    """A pickle payload: unpickling it runs Python code."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return (builtins.exec, (self.code,))


def truncate(path: Path, other: Path, case: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path: Path, other: Path, case: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def delete(path: Path, other: Path, case: Path) -> None:
    path.unlink()


def append(path: Path, other: Path, case: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\0appended by the fault audit\n")


def swap(path: Path, other: Path, case: Path) -> None:
    shutil.copyfile(other, path)


def crafted_pickle(path: Path, other: Path, case: Path) -> None:
    import torch

    torch.save({"state": Shell(f"touch {case / MARKER}")}, path)


def forged_pickle(path: Path, other: Path, case: Path) -> None:
    """A code-running pickle with the manifest's hash and size recomputed, as anyone who can write it can."""
    import torch

    torch.save({"state": Exec(f"open({str(case / MARKER)!r}, 'w').close()")}, path)
    rehash(path)


def rehash(path: Path) -> None:
    sys.path.insert(0, str(REPO))
    from trainer.integrity import hash_file

    ckpt = next(p for p in path.parents if (p / "meta.json").exists())
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["manifest"][path.relative_to(ckpt).as_posix()] = hash_file(path)
    (ckpt / "meta.json").write_text(json.dumps(meta))


DAMAGES: dict[str, Callable[[Path, Path, Path], None]] = {
    "truncate": truncate, "flip": flip, "delete": delete, "append": append, "swap": swap,
    "pickle": crafted_pickle, "forged-pickle": forged_pickle,
}  # fmt: skip
CKPT_FILES = {  # the damages worth trying per file
    "model.safetensors": ("truncate", "flip", "delete", "append", "swap"),
    "optimizer.pt": tuple(DAMAGES),
    "state.pt": tuple(DAMAGES),
    "meta.json": ("truncate", "flip", "delete", "append", "swap"),
    "validated.json": ("flip", "delete", "swap"),
}
CKPT_COMMANDS = {
    "fit": (lambda: trainer_cmd(*RESUME), "recover"),
    "validate": (lambda: trainer_cmd(*VALIDATE), "notice"),
    "export": (lambda: trainer_cmd(*EXPORT6, timeout=60), "refuse"),
}
ON_VALIDATE = {("model.safetensors", d) for d in ("truncate", "flip", "swap")} | {
    ("optimizer.pt", "flip"), ("optimizer.pt", "append"), ("optimizer.pt", "forged-pickle"),
    ("state.pt", "forged-pickle"), ("state.pt", "delete"), ("meta.json", "flip"), ("meta.json", "delete"),
}  # fmt: skip
ON_EXPORT = {("model.safetensors", d) for d in ("truncate", "flip", "delete", "swap")} | {
    ("optimizer.pt", "flip"), ("optimizer.pt", "delete"), ("optimizer.pt", "forged-pickle"),
    ("optimizer.pt", "pickle"), ("state.pt", "forged-pickle"), ("meta.json", "delete"), ("meta.json", "truncate"),
}  # fmt: skip


def damaged(file: str, damage: str, command: str) -> Case:
    """The CLI run's newest checkpoint (step 6) with `file` damaged, then `command`."""
    make, expect = CKPT_COMMANDS[command]
    if file == "validated.json" and damage != "delete":
        expect = (
            "answer"  # a damaged record of a validation that passed: the files still verify by the manifest
        )

    def prepare(folder: Path) -> Command:
        FIX.copy("cli", folder)
        DAMAGES[damage](folder / STEP6 / file, folder / STEP4 / file, folder)
        return make()

    names = rf"step-0*6|{re.escape(file)}|{re.escape(STEP6)}"
    return Case(f"ckpt-{command}-{file}-{damage}", f"{damage} step-6/{file}; trainer {command}", prepare, expect, names)  # fmt: skip


def checkpoint_cases() -> list[Case]:
    cases = [damaged(f, d, "fit") for f, ds in CKPT_FILES.items() for d in ds]
    cases += [damaged(f, d, "validate") for f, d in sorted(ON_VALIDATE)]
    cases += [damaged(f, d, "export") for f, d in sorted(ON_EXPORT)]
    return cases


def all_bad(folder: Path) -> Command:
    FIX.copy("cli", folder)
    for ckpt in sorted((folder / "run/checkpoints").glob("step-*")):
        flip(ckpt / "optimizer.pt", ckpt, folder)
    two = EVERY_2.replace("save_top_k: -1", "save_top_k: 2")
    return trainer_cmd("fit", TINY, *RUN, two, "trainer.max_steps=6", "--ckpt-path", "last")


def all_bad_validate(folder: Path) -> Command:
    all_bad(folder)
    return trainer_cmd(*VALIDATE)


def step_collides(folder: Path) -> Command:
    FIX.copy("cli", folder)
    meta = folder / STEP6 / "meta.json"
    meta.write_text(meta.read_text().replace('"step": 6', '"step": 4'))
    return trainer_cmd(*RESUME)


def unlisted(command: list[str]) -> Callable[[Path], Command]:
    """optimizer.pt's manifest entry removed, then a byte of it flipped."""

    def prepare(folder: Path) -> Command:
        FIX.copy("cli", folder)
        meta_path = folder / STEP6 / "meta.json"
        meta = json.loads(meta_path.read_text())
        del meta["manifest"]["optimizer.pt"]
        meta_path.write_text(json.dumps(meta, indent=1))
        flip(folder / STEP6 / "optimizer.pt", folder, folder)
        return trainer_cmd(*command)

    return prepare


def chmod_checkpoints(folder: Path, mode: int, command: list[str]) -> Command:
    """The CLI run with its checkpoints folder chmod `mode`, then `command` by a root that obeys it."""
    FIX.copy("cli", folder)
    os.chmod(folder / "run/checkpoints", mode)
    return Command([TRAINER, *command], no_dac=True)


def file_at(rel: str) -> Callable[[Path], Command]:
    def prepare(folder: Path) -> Command:
        if rel != "run":
            (folder / "run").mkdir()
        (folder / rel).write_text("the user's notes, not a folder\n")
        return trainer_cmd("fit", TINY, *RUN, "trainer.max_steps=4", timeout=90)

    return prepare


def tmpfs(folder: Path, size: int) -> Path:
    """A tmpfs of `size` bytes at folder/disk (unmounted by `unmount` after the case)."""
    disk = folder / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True)
    return disk


def disk_full_resume(folder: Path) -> Command:
    """The run on a tmpfs 1 MB larger than it: the step-8 checkpoint cannot be written."""
    FIX.copy("cli", folder / "src")
    used = sum(p.stat().st_size for p in (folder / "src").rglob("*") if p.is_file())
    disk = tmpfs(folder, used + (1 << 20))
    shutil.copytree(folder / "src/run", disk / "run")
    shutil.rmtree(folder / "src")
    return trainer_cmd(*[a.replace("default_root_dir=run", "default_root_dir=disk/run") for a in RESUME])


def file_size_limit(folder: Path) -> Command:
    FIX.copy("cli", folder)
    cmd = trainer_cmd(*RESUME)
    cmd.fsize = 1_000_000  # model.safetensors (0.6 MB) fits, optimizer.pt (1.3 MB) does not
    return cmd


def export_full(folder: Path) -> Command:
    FIX.copy("cli", folder)
    tmpfs(folder, 256 * 1024)
    return trainer_cmd("export", STEP6, "disk/out", timeout=60)


def ddp_case(name: str, damage: Callable[[Path], None], argv: list[str], expect: str) -> Case:
    def prepare(folder: Path) -> Command:
        FIX.copy("ddp", folder)
        damage(folder / "run/checkpoints/step-00000004")
        return trainer_cmd(*argv, timeout=180)

    return Case(name, name.replace("-", " "), prepare, expect, r"\.metadata|\.distcp|step-0*4|dcp")


def forge_metadata(ckpt: Path) -> None:
    path = ckpt / "dcp" / ".metadata"
    path.write_bytes(pickle.dumps(Shell(f"touch {ckpt.parents[2] / MARKER}")))
    rehash(path)


def truncate_metadata(ckpt: Path) -> None:
    truncate(ckpt / "dcp" / ".metadata", ckpt, ckpt)


def flip_shard(ckpt: Path) -> None:
    flip(sorted((ckpt / "dcp").glob("*.distcp"))[0], ckpt, ckpt)


DDP = ["strategy.name=ddp", "trainer.devices=2", "data.global_batch_size=8"]


def ddp_cases() -> list[Case]:
    resume = ["fit", TINY, *RUN, *DDP, "trainer.max_steps=6", "--ckpt-path", "last"]
    export = ["export", "run/checkpoints/step-00000004", "out"]
    return [
        ddp_case("dcp-meta-forged-fit", forge_metadata, resume, "recover"),
        ddp_case("dcp-meta-forged-validate", forge_metadata, ["validate", TINY, *RUN, *DDP], "notice"),
        ddp_case("dcp-meta-forged-export", forge_metadata, export, "refuse"),
        ddp_case("dcp-meta-truncated-export", truncate_metadata, export, "refuse"),
        ddp_case("dcp-shard-flipped-export", flip_shard, export, "refuse"),
    ]


def newest_step_at_least(n: int) -> Callable[[Path, str], str | None]:
    def check(folder: Path, last: str) -> str | None:
        steps = [int(p.name.split("-")[-1]) for p in (folder / "run/checkpoints").glob("step-*")]
        return None if max(steps, default=0) >= n else f"no checkpoint at step >= {n}: {sorted(steps)}"

    return check


def stop_checkpoint(folder: Path, last: str) -> str | None:
    """The stop line names its step and a checkpoint of that step, which exists."""
    said = re.search(r"stopped at step (\d+) .*checkpoint (\S+);", last)
    if not said:
        return "the stop line names no checkpoint"
    step, path = int(said.group(1)), folder / said.group(2)
    if not (path / "meta.json").is_file() or json.loads((path / "meta.json").read_text())["step"] != step:
        return f"no checkpoint of step {step} at {said.group(2)}"
    return None


def cli_signal(sig: int, again: bool = False) -> Callable[[Path], Command]:
    """A long CLI fit (the recipe's checkpoint every 100 steps) sent `sig` once its metrics log has step 3
    (`again`: a second one once it says it is stopping)."""

    def prepare(folder: Path) -> Command:
        argv = ["fit", TINY, *RUN[:-1], "trainer.max_steps=5000", "trainer.val_check_interval=1000",
                "trainer.log_every_n_steps=1"]  # fmt: skip
        signals = [("run/logs/metrics.jsonl", r'"step": 3\b', sig)]
        signals += [("output", r"finishing the step in flight", sig)] * again
        return Command([TRAINER, *argv], signals=tuple(signals))

    return prepare


def signal_cases() -> list[Case]:
    stopped = r"stopped at step \d+"
    return [
        Case("cli-ctrl-c", "Ctrl-C once step 3 is logged (of 5000)", cli_signal(signal.SIGINT), "signal", stopped,
             130, stop_checkpoint),
        Case("cli-sigterm", "SIGTERM once step 3 is logged (of 5000)", cli_signal(signal.SIGTERM), "signal", stopped,
             143, stop_checkpoint),
        Case("cli-ctrl-c-twice", "a second Ctrl-C while it stops", cli_signal(signal.SIGINT, again=True), "signal", r"Ctrl-C|interrupt",
             130),
        Case("api-sigint", "os.kill(SIGINT) in step 3", api_prep("--max-steps", "50", "--signal-at", "3"),
             "signal", stopped, 130, stop_checkpoint, api=True),
        Case("api-sigterm", "os.kill(SIGTERM) in step 3",
             api_prep("--max-steps", "50", "--signal-at", "3", "--signal", "SIGTERM"), "signal", stopped, 143,
             stop_checkpoint, api=True),
        Case("api-resume-after-sigint", "stopped by SIGINT at step 3, resumed to 8", resume_after_signal, "ok",
             api=True, check=newest_step_at_least(8)),
    ]  # fmt: skip


def api_prep(*args: str, base: bool = False, damage: Callable[[Path], None] | None = None) -> Callable[[Path], Command]:  # fmt: skip
    def prepare(folder: Path) -> Command:
        if base:
            FIX.copy("api", folder)
        else:
            (folder / "fit.py").write_text(API_SCRIPT)
        if damage:
            damage(folder)
        return api(*args)

    return prepare


def resume_after_signal(folder: Path) -> Command:
    (folder / "fit.py").write_text(API_SCRIPT)
    first = execute(api("--max-steps", "8", "--signal-at", "3"), folder, FIX.env(folder))
    if first.rc != 130:
        raise RuntimeError(f"the interrupted fit exited {first.rc}: {last_line(first)}")
    return api("--max-steps", "8", "--ckpt-path", "last")


def api_damage(file: str, fn: Callable[[Path, Path, Path], None]) -> Callable[[Path], None]:
    return lambda folder: fn(folder / STEP6 / file, folder / STEP4 / file, folder)


def api_all_bad(folder: Path) -> None:
    for ckpt in (folder / "run/checkpoints").glob("step-*"):
        flip(ckpt / "optimizer.pt", ckpt, folder)


def api_unlisted(folder: Path) -> None:
    meta_path = folder / STEP6 / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["manifest"]["optimizer.pt"]
    meta_path.write_text(json.dumps(meta))
    swap(folder / STEP6 / "optimizer.pt", folder / STEP4 / "optimizer.pt", folder)


def replicas_group_lost(folder: Path) -> Command:
    (folder / "fit.py").write_text(API_SCRIPT)
    argv = ["replicas", "--groups", "2", "--min-replicas", "2", "--max-restarts", "0", "--heartbeat-timeout-ms",
            "1000", "fit.py", "--fault-tolerance", "--exit-at", "3", "--max-steps", "50"]  # fmt: skip
    return trainer_cmd(*argv, timeout=180)


def api_cases() -> list[Case]:
    resume = ("--max-steps", "8", "--ckpt-path", "last")
    six = r"step-0*6|optimizer\.pt|state\.pt|model\.safetensors"
    damages = {
        "optimizer-flip": api_damage("optimizer.pt", flip),
        "state-delete": api_damage("state.pt", delete),
        "model-truncate": api_damage("model.safetensors", truncate),
        "state-forged-pickle": api_damage("state.pt", forged_pickle),
        "optimizer-unlisted-swapped": api_unlisted,
    }
    cases = [
        Case(f"api-resume-{name}", f"{name} in step 6; fit(ckpt_path='last')", api_prep(*resume, base=True, damage=d),
             "recover", six, api=True)
        for name, d in damages.items()
    ]  # fmt: skip
    cases += [
        Case("api-resume-all-bad", "optimizer.pt flipped in every checkpoint; fit(ckpt_path='last')",
             api_prep(*resume, base=True, damage=api_all_bad), "recover", r"step-0*\d|scratch|no checkpoint", api=True),
        Case("api-nan-no-checkpointing", "loss NaN from step 3, enable_checkpointing=False",
             api_prep("--max-steps", "6", "--no-checkpointing", "--nan-from", "3"), "refuse", r"finite|nan", api=True),
        Case("replicas-group-lost", "trainer replicas --groups 2 --min-replicas 2: group 1 dies at step 3",
             replicas_group_lost, "refuse", r"quorum|group 1|replica", api=True),
        Case("api-nan-checkpointing", "loss NaN from step 3, ModelCheckpoint(every_n_steps=2)",
             api_prep("--max-steps", "6", "--nan-from", "3"), "refuse", r"finite|nan", api=True),
    ]  # fmt: skip
    return cases


# --- data --------------------------------------------------------------------------------------------------------


def first_lines(source: Path, n: int, edits: dict[int, Callable[[dict], object] | str]) -> str:
    rows = source.read_text().splitlines()[:n]
    for i, edit in edits.items():
        rows[i] = edit if isinstance(edit, str) else json.dumps(edit(json.loads(rows[i])))
    return "\n".join(rows) + "\n"


def hf_case(name: str, recipe: str, source: str, edits: dict, expect: str = "refuse", names: str = "", extra=()) -> Case:  # fmt: skip
    def prepare(folder: Path) -> Command:
        (folder / "rows.jsonl").write_text(first_lines(RECIPES / "data" / source, 48, edits))
        argv = ["fit", str(RECIPES / recipe), "model.hf=new:base", "data.path=rows.jsonl", "data.batch_size=4",
                "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                "trainer.default_root_dir=run", "trainer.warmup_steps=1", "callbacks=[]", *extra]  # fmt: skip
        return trainer_cmd(*argv, timeout=180)

    return Case(name, name.replace("-", " "), prepare, expect, names or r"rows\.jsonl:\d+")


def lm_data_case(
    name: str, make: Callable[[Path], str], expect: str = "refuse", names: str = r"data"
) -> Case:
    def prepare(folder: Path) -> Command:
        return trainer_cmd("fit", TINY, *RUN, "trainer.max_steps=2", f"data.path={make(folder)}", timeout=90)

    return Case(name, name.replace("-", " "), prepare, expect, names)


def binary_txt(folder: Path) -> str:
    (folder / "data").mkdir()
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 64
    (folder / "data" / "image.txt").write_bytes(png)
    return "data"


def empty_folder(folder: Path) -> str:
    (folder / "data").mkdir()
    return "data"


def empty_txt(folder: Path) -> str:
    (folder / "data").mkdir()
    (folder / "data" / "empty.txt").write_text("")
    return "data/empty.txt"


def bad_json_lines(folder: Path) -> str:
    (folder / "text.jsonl").write_text('{"text": "hello there"}\n{"text": oops}\n{"text": "more"}\n')
    return "text.jsonl"


def without(key: str) -> Callable[[dict], dict]:
    return lambda row: {k: v for k, v in row.items() if k != key}


def data_cases() -> list[Case]:
    no_content = lambda row: {"messages": [{"role": "user"}, *row["messages"][1:]]}  # noqa: E731
    return [
        lm_data_case("data-binary-txt", binary_txt, names=r"image\.txt"),
        lm_data_case("data-empty-folder", empty_folder),
        lm_data_case("data-empty-txt", empty_txt, names=r"empty\.txt|data"),
        lm_data_case("data-missing-path", lambda f: "no/such/data", names=r"no/such/data"),
        lm_data_case("data-non-json-line", bad_json_lines, names=r"text\.jsonl:2"),
        hf_case("dpo-non-json-line", "hf_dpo_tiny.yaml", "dpo_tiny.jsonl", {5: '{"prompt": "x", "chosen": '}),
        hf_case("dpo-missing-rejected", "hf_dpo_tiny.yaml", "dpo_tiny.jsonl", {5: without("rejected")}),
        hf_case("dpo-chosen-number", "hf_dpo_tiny.yaml", "dpo_tiny.jsonl", {9: lambda r: {**r, "chosen": 123}}),
        hf_case("dpo-prompt-null", "hf_dpo_tiny.yaml", "dpo_tiny.jsonl", {3: lambda r: {**r, "prompt": None}}),
        hf_case("dpo-skip-bad-rows", "hf_dpo_tiny.yaml", "dpo_tiny.jsonl", {5: without("rejected")}, "recover",
                r"skip|left out", ["data.skip_bad_rows=true"]),
        hf_case("sft-message-without-content", "hf_sft_llama_tiny.yaml", "sft_tiny.jsonl", {4: no_content}),
        hf_case("sft-non-json-line", "hf_sft_llama_tiny.yaml", "sft_tiny.jsonl", {7: "not json at all"}),
        hf_case("sft-messages-not-a-list", "hf_sft_llama_tiny.yaml", "sft_tiny.jsonl", {2: lambda r: {"messages": "hi"}}),  # noqa: E501
        hf_case("sft-packing-bad-rows", "hf_sft_llama_tiny.yaml", "sft_tiny.jsonl", {4: no_content},
                extra=["data.sft_packing=true"]),
        hf_case("sft-packing-skip-bad-rows", "hf_sft_llama_tiny.yaml", "sft_tiny.jsonl", {4: no_content},
                "recover", r"skip|left out", ["data.sft_packing=true", "data.skip_bad_rows=true"]),
    ]  # fmt: skip


# --- config and tools ---------------------------------------------------------------------------------------------


def argv_case(name: str, argv: list[str], expect: str, names: str = r".", timeout: float = 60) -> Case:
    return Case(name, " ".join(a if len(a) < 30 else "..." for a in argv[:6]), lambda folder: trainer_cmd(*argv, timeout=timeout), expect, names)  # fmt: skip


def recipe_file(name: str, content: str, expect: str, names: str) -> Case:
    def prepare(folder: Path) -> Command:
        (folder / "recipe.yaml").write_text(content)
        return trainer_cmd("fit", "recipe.yaml", timeout=60)

    return Case(name, f"a recipe: {content[:30]!r}", prepare, expect, names)


def config_cases() -> list[Case]:
    fit = ["fit", TINY, *RUN, "trainer.max_steps=2"]
    l8b = str(RECIPES / "llama_8b.yaml")
    ft = ["replicas", "--groups", "1", TINY, *SMALL, "trainer.max_steps=2", "trainer.default_root_dir=run"]
    return [
        argv_case("cfg-unknown-key", [*fit, "trainer.max_stepz=5"], "refuse", "max_stepz"),
        argv_case("cfg-wrong-type", [*fit, "trainer.max_steps=abc"], "refuse", "max_steps"),
        argv_case("cfg-negative-steps", [*fit, "trainer.max_steps=-5"], "refuse", "max_steps"),
        argv_case("cfg-zero-batch", [*fit, "data.batch_size=0"], "refuse", "batch_size"),
        argv_case("cfg-negative-lr", [*fit, "optimizer.lr=-1"], "refuse", r"\blr\b"),
        argv_case("cfg-bad-precision", [*fit, "trainer.precision=17"], "refuse", "precision"),
        argv_case("cfg-override-without-value", [*fit, "trainer.max_steps"], "refuse", "max_steps"),
        argv_case("cfg-missing-recipe", ["fit", "no_such_recipe.yaml"], "refuse", r"no_such_recipe\.yaml"),
        recipe_file("cfg-recipe-not-yaml", "model: [unclosed\n  dim: 3\n", "refuse", r"recipe\.yaml"),
        recipe_file("cfg-recipe-a-list", "- 1\n- 2\n", "refuse", r"recipe\.yaml"),
        argv_case("cfg-ckpt-path-missing", [*fit, "--ckpt-path", "no/such/ckpt"], "refuse", r"no/such/ckpt"),
        argv_case("cli-version", ["--version"], "ok"),
        argv_case("doctor-devices-0", ["doctor", "--devices", "0"], "refuse", "--devices"),
        argv_case("doctor-devices-negative", ["doctor", "--devices", "-2"], "refuse", "--devices"),
        argv_case("doctor-iters-0", ["doctor", "--devices", "2", "--iters", "0"], "refuse", "--iters"),
        argv_case("plan-gpus-1e9", ["plan", l8b, "--gpus", "1000000000"], "answer", r"--gpus|1,000,000,000 GPUs", timeout=90),
        argv_case("plan-gpus-0", ["plan", l8b, "--gpus", "0"], "refuse", "--gpus"),
        argv_case("plan-gpus-negative", ["plan", l8b, "--gpus", "-8"], "refuse", "--gpus"),
        argv_case("plan-storage-0", ["plan", l8b, "--gpus", "8", "--storage-gbps", "0"], "refuse", "--storage-gbps"),
        argv_case("plan-mtbf-negative", ["plan", l8b, "--gpus", "8", "--mtbf-hours", "-1"], "refuse", "--mtbf-hours"),
        argv_case("plan-gpu-memory-0", ["plan", l8b, "--gpus", "8", "--gpu-memory", "0GB"], "refuse", r"--gpu-memory|'0GB'"),
        argv_case("plan-8-gpus", ["plan", l8b, "--gpus", "8"], "ok"),
        argv_case("replicas-groups-0", ["replicas", "--groups", "0", TINY], "refuse", "--groups"),
        argv_case("replicas-bad-quorum-timeout", [*ft, "fault_tolerance.quorum_timeout_s=abc"], "refuse",
                  "quorum_timeout_s"),
        argv_case("replicas-huge-timeout", [*ft, "fault_tolerance.timeout_s=1e12"], "refuse", "timeout_s"),
    ]  # fmt: skip


# --- the table of cases ------------------------------------------------------------------------------------------


def folder_cases() -> list[Case]:
    return [
        Case("ckpt-fit-all-bad", "optimizer.pt flipped in every checkpoint; fit --ckpt-path last (save_top_k 2)",
             all_bad, "recover", r"step-0*\d|scratch|no checkpoint", check=newest_step_at_least(6)),
        Case("ckpt-validate-all-bad", "optimizer.pt flipped in every checkpoint; validate", all_bad_validate,
             "notice", r"step-0*\d|checkpoint"),
        Case("ckpt-fit-step-collides", "step-6/meta.json says step 4; fit --ckpt-path last", step_collides,
             "recover", r"step-0*6|meta\.json", check=newest_step_at_least(8)),
        Case("ckpt-fit-unlisted", "optimizer.pt dropped from the manifest and flipped; fit", unlisted(RESUME),
             "recover", r"step-0*6|optimizer\.pt"),
        Case("ckpt-validate-unlisted", "optimizer.pt dropped from the manifest and flipped; validate",
             unlisted(VALIDATE), "notice", r"step-0*6|optimizer\.pt"),
        Case("ckpt-export-unlisted", "optimizer.pt dropped from the manifest and flipped; export",
             unlisted(EXPORT6), "refuse", r"step-0*6|optimizer\.pt"),
        Case("folder-read-only", "checkpoints folder chmod 555 (root without DAC override); fit --ckpt-path last",
             lambda f: chmod_checkpoints(f, 0o555, RESUME), "refuse", r"run/checkpoints"),
        Case("folder-unreadable-fit", "checkpoints folder chmod 000 (root without DAC override); fit --ckpt-path last",
             lambda f: chmod_checkpoints(f, 0o000, RESUME), "refuse", r"run/checkpoints"),
        Case("folder-unreadable-validate", "checkpoints folder chmod 000 (root without DAC override); validate",
             lambda f: chmod_checkpoints(f, 0o000, VALIDATE), "refuse", r"run/checkpoints"),
        Case("folder-run-is-a-file", "a file where the run folder goes; fit", file_at("run"), "refuse", r"\brun\b"),
        Case("folder-checkpoints-is-a-file", "a file at run/checkpoints; fit", file_at("run/checkpoints"),
             "refuse", r"run/checkpoints"),
        Case("disk-full-tmpfs", "run on a tmpfs 1 MB larger than it; fit --ckpt-path last to 8", disk_full_resume,
             "refuse", r"disk/run/checkpoints|step-0*8", owned=("disk/run/logs/", "disk/run/export/")),
        Case("disk-file-size-limit", "RLIMIT_FSIZE 1 MB; fit --ckpt-path last to 8", file_size_limit, "refuse",
             r"run/checkpoints|step-0*8|optimizer\.pt"),
        Case("disk-full-export", "export into a 256 KB tmpfs", export_full, "refuse", r"disk/out"),
    ]  # fmt: skip


def lora_resume(base: str, edit: Callable[[Path], None]) -> Callable[[Path], Command]:
    def prepare(folder: Path) -> Command:
        FIX.copy("lora", folder)
        edit(folder)
        return trainer_cmd(
            "fit", SFT, *LORA, f"model.hf={base}", "trainer.max_steps=6", "--ckpt-path", "last"
        )

    return prepare


def fresh_over_other_run(folder: Path) -> Command:
    """Another run's checkpoints (steps 2, 4, 6) in the root a new run (no --ckpt-path) writes to."""
    FIX.copy("cli", folder)
    two = EVERY_2.replace("save_top_k: -1", "save_top_k: 2")
    return trainer_cmd("fit", TINY, *RUN, two, "trainer.max_steps=6")


def explicit(argv: list[str]) -> Callable[[Path], Command]:
    """`argv` + --ckpt-path step 6, whose optimizer.pt has a byte flipped."""

    def prepare(folder: Path) -> Command:
        FIX.copy("cli", folder)
        flip(folder / STEP6 / "optimizer.pt", folder, folder)
        return trainer_cmd(*argv, "--ckpt-path", STEP6)

    return prepare


def export_into_file(folder: Path) -> Command:
    FIX.copy("cli", folder)
    (folder / "out").write_text("the user's file\n")
    return trainer_cmd("export", STEP6, "out", timeout=60)


def more_cases() -> list[Case]:
    six = r"step-0*6|optimizer\.pt"
    fit8 = ["fit", TINY, *RUN, "trainer.max_steps=8"]
    return [
        Case("ckpt-fit-explicit-flipped", "--ckpt-path step-6 (optimizer.pt flipped); fit", explicit(fit8),
             "refuse", six),
        Case("ckpt-validate-explicit-flipped", "--ckpt-path step-6 (optimizer.pt flipped); validate",
             explicit(VALIDATE), "refuse", six),
        Case("ckpt-fresh-over-other-run", "a new run (no --ckpt-path, save_top_k 2) where another run saved",
             fresh_over_other_run, "answer", r"step-0*\d|run/checkpoints"),
        Case("export-missing-checkpoint", "trainer export of a folder that does not exist",
             lambda f: trainer_cmd("export", "run/checkpoints/step-00000042", "out"), "refuse", r"step-0*42"),
        Case("export-out-is-a-file", "trainer export into a path that is the user's file", export_into_file,
             "refuse", r"\bout\b"),
        Case("lora-base-copied", "LoRA resumed on a byte-identical copy of its base in another folder",
             lora_resume("base2", lambda f: shutil.copytree(f / "base", f / "base2")), "ok"),
        Case("lora-base-changed", "LoRA resumed after its base's weights were changed in place",
             lora_resume("base", lambda f: flip(f / "base/model.safetensors", f, f)), "notice", r"\bbase\b"),
        Case("cli-huge-lr", "optimizer.lr=1e30 (the weights overflow); fit", lambda f: trainer_cmd(*fit8[:-1],
             "trainer.max_steps=6", "optimizer.lr=1e30", "trainer.gradient_clip_val=null"), "refuse", r"finite"),
    ]  # fmt: skip


def all_cases() -> list[Case]:
    return [*checkpoint_cases(), *folder_cases(), *ddp_cases(), *signal_cases(), *api_cases(), *data_cases(),
            *config_cases(), *more_cases()]  # fmt: skip


# --- running the audit ---------------------------------------------------------------------------------------------


def unmount(folder: Path) -> None:
    disk = folder / "disk"
    if disk.is_mount():
        subprocess.run(["umount", str(disk)], check=False)


def run_case(case: Case, work: Path) -> Result:
    folder = work / "cases" / case.name
    folder.mkdir(parents=True)
    try:
        cmd = case.prepare(folder)
        before = snapshot(folder, case.owned)
        r = execute(cmd, folder, FIX.env(folder))
        r.last, r.folder = last_line(r), folder
        r.verdict, r.why = judge(case, r, folder, lost_files(folder, before))
        (folder / "audit-command.txt").write_text(" ".join(cmd.argv) + "\n")  # for a look at a kept folder
        (folder / "audit-stdout.txt").write_text(r.stdout)
        (folder / "audit-stderr.txt").write_text(r.stderr)
    except Exception as err:  # a case that could not be set up is reported, not fatal to the audit
        r = Result(
            None, "", "", False, 0.0, last=f"{type(err).__name__}: {err}", verdict="ERROR", folder=folder
        )
        r.why = "setup failed"
    finally:
        unmount(folder)
    return r


def row(case: Case, r: Result) -> str:
    why = f" [{r.why}]" if r.verdict != "ok" and r.why else ""
    warned = f" | warned: {r.warning[:150]}" if r.rc == 0 and r.warning else ""
    return f"{case.name:<44} {r.verdict:<8} {r.rc!s:>4} {r.seconds:5.0f}s  {r.last[:150]}{warned}{why}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    parser.add_argument(
        "--keep", action="store_true", help="keep every case folder, not only the non-ok ones"
    )
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args()
    cases = [c for c in all_cases() if not args.only or args.only in c.name]
    if args.list:
        print("\n".join(f"{c.name:<44} {c.expect:<8} {c.what}" for c in cases))
        return 0
    work = Path(tempfile.mkdtemp(prefix="fault-audit-"))
    global FIX
    FIX = Fixtures(work)
    print(f"{len(cases)} cases in {work}", flush=True)
    print(f"{'case':<44} {'verdict':<8} {'rc':>4} {'time':>6}  last line [why]", flush=True)
    results: list[tuple[Case, Result]] = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for case, r in zip(cases, pool.map(functools.partial(run_case, work=work), cases), strict=True):
            results.append((case, r))
            print(row(case, r), flush=True)
            if r.verdict == "ok" and not args.keep:
                shutil.rmtree(r.folder, ignore_errors=True)
    report(results, work)
    return 0 if all(r.verdict == "ok" for _, r in results) else 1


def report(results: list[tuple[Case, Result]], work: Path) -> None:
    counts = Counter(r.verdict for _, r in results)
    order = ["ok", "LOST", "SILENT", "HANG", "CODE-RUN", "UGLY", "WRONG", "ERROR"]
    print("\ntotals: " + ", ".join(f"{v} {counts.get(v, 0)}" for v in order) + f" (of {len(results)})")
    bad = [(c, r) for c, r in results if r.verdict != "ok"]
    if bad:
        print(f"not ok (folders kept under {work / 'cases'}):")
        for case, r in bad:
            print(f"  {r.verdict:<8} {case.name}: {case.what} -> rc {r.rc}: {r.last[:200]}  [{r.why}]")


FIX: Fixtures  # set by main: the runs cases copy

if __name__ == "__main__":
    sys.exit(main())
