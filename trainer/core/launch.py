"""Process launching: find the world a process belongs to (torchrun, SLURM) or start it (self-spawn).

Self-spawn re-executes the user's own command (the script, `python -m pkg`, or `trainer fit ...`) for
local ranks 1..N-1 with torchrun's environment variables, and this process becomes rank 0, as
Lightning's subprocess launcher does. Chosen over torch's elastic agent API because the agent runs the
work in child processes only: the user's process would return from `fit` holding an untrained model,
and every object given to `fit` would have to be picklable. With re-execution nothing is pickled and
the code after `fit` runs in each rank, as it does under torchrun. A watchdog thread in rank 0 ends the
whole job as soon as any child dies (an exception or a SIGKILL), and children die with rank 0.

Each child has a pipe to rank 0: it says when it reaches the job (rank 0 joins the process group only
then) and sends the text of the error that ends it, so the last line of the job's output names the rank
that failed and its error, whichever rank it was.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.core.logging import log

_REPORTED_BY = "_trainer_reported_by"  # attribute on an exception: which rank printed its traceback
_PIPE_FD = "TRAINER_SPAWN_PIPE_FD"  # a spawned rank's end of the pipe on which it tells rank 0 how it goes
_ARRIVED = b"+"  # sent first, as the rank enters the job; the text of its uncaught error, if any, follows
JOIN_TIMEOUT_S = 600.0  # how long rank 0 waits for the ranks it started to reach the job (torchrun's default)


@dataclass(frozen=True)
class World:
    """Where this process sits in the job."""

    source: str  # "torchrun", "slurm" or "spawned"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int = 0
    agent_store: bool = False  # torchelastic's agent hosts the TCPStore server


def detect_world(env: dict[str, str] | None = None) -> World | None:
    """The world described by torchrun's (or our spawner's) variables, or SLURM's; None outside both."""
    env = dict(os.environ if env is None else env)
    if all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        world_size, local_world = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
        return World(
            source="torchrun" if "TORCHELASTIC_RUN_ID" in env else "spawned",
            rank=int(env["RANK"]),
            local_rank=int(env["LOCAL_RANK"]),
            world_size=world_size,
            local_world_size=local_world,
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        )
    if (
        "SLURM_PROCID" in env
        and "SLURM_NTASKS" in env
        and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    ):
        nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST", "127.0.0.1"))
        world_size = int(env["SLURM_NTASKS"])
        local_world = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or world_size // max(
            len(nodes), 1
        )
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return World(
            source="slurm",
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=world_size,
            local_world_size=local_world,
            master_addr=env.get("MASTER_ADDR", nodes[0]),
            master_port=int(env.get("MASTER_PORT", 15000 + job_id % 20000)),  # same on every task of the job
            restart_count=int(env.get("SLURM_RESTART_COUNT", 0)),
        )
    return None


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list ("gpu[01-03,07],login1") as host names, in order."""
    hosts = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if not ranges:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    return hosts


_spawned_store: list[Any] = []  # the store rank 0 of a self-spawned job bound before starting the others
_to_rank_zero: list[int] = []  # in a rank that spawn_and_run started: its end of the pipe to rank 0


def spawn_and_run(nprocs: int, function: Callable[..., Any], *args: Any) -> Any:
    """Start local ranks 1..nprocs-1 as copies of this command, become rank 0, run `function`.

    Rank 0 binds its TCPStore on port 0 before starting the others and hands them the port the system
    chose: no window in which another process can take a port that was found free but not yet bound.
    It runs `function` once every other rank has reached the job (`report_arrival`): their start-up
    (imports, building the model) is no collective, and must not count against the collective timeout."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False)
    _spawned_store[:] = [store]
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "NODE_RANK": "0",
    }
    os.environ.update(env, RANK="0", LOCAL_RANK="0")
    children = [
        _Child(r, {**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(1, nprocs)
    ]
    _wait_for_arrivals(children)
    _print_shared_errors_once()
    watchdog = _Watchdog(children)
    watchdog.start()
    # ranks 1..N-1 run the rest of the program too (collectives included): rank 0 waits for them at exit
    atexit.register(_wait_for_children, children, watchdog)
    try:
        return function(*args)
    except SystemExit:  # a clean end the function chose (a signal's stop): the others end as it did
        watchdog.stop()
        raise
    except BaseException as err:
        watchdog.stop()
        cause = _job_error(err, _failed(children, grace_s=1.0))  # a dead child is usually why rank 0 failed
        _terminate(children)
        if cause is err:
            raise
        raise cause from err


def report_arrival() -> None:
    """In a rank that `spawn_and_run` started: tell rank 0, once, that this rank has reached the job (rank 0
    joins the process group only when every rank has); elsewhere nothing."""
    fd = os.environ.pop(_PIPE_FD, None)  # popped: a process this rank starts is no rank of the job
    if fd is not None:
        _to_rank_zero[:] = [int(fd)]
        _send_to_rank_zero(_ARRIVED)


def _wait_for_children(children: list[_Child], watchdog: _Watchdog) -> None:
    """At rank 0's exit: wait for the other ranks; the job fails if one of them failed."""
    watchdog.stop()
    for child in children:
        child.process.wait()
    destroy_process_group()  # after the children: rank 0 hosts the store they use until the end
    failed = _failed(children)
    for child in failed:
        log.error(child.describe())
    if failed:
        sys.stderr.flush()
        os._exit(1)


def exit_quietly_when_done() -> None:
    """For a rank that `spawn_and_run` started: end the process right after the atexit handlers, before
    the interpreter's finalisation, with 1 after an uncaught exception and 0 otherwise. The exception's
    text goes to rank 0, which names it as the job's error (`_job_error`).

    Why: if a gloo process group still has worker threads when Python finalises (FSDP2/DTensor keep
    references to it), a thread that needs the GIL is force-unwound and the process aborts
    ('terminate called without an active exception', seen in about 1 of 25 FSDP runs here). Rank 0 then
    reports a failure for a run that finished. Registered before `destroy_process_group`, so it runs after.
    """
    failed = []
    previous = sys.excepthook

    def hook(*exc_info: Any) -> None:
        failed.append(True)
        previous(*exc_info)
        _send_to_rank_zero(_error_text(exc_info[1]).encode())

    sys.excepthook = hook

    def finish() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if failed else 0)

    atexit.register(finish)


def take_spawned_store() -> Any:
    """The TCPStore `spawn_and_run` bound for this rank 0, once; None in any other process."""
    return _spawned_store.pop() if _spawned_store else None


def destroy_process_group() -> None:
    """Shut the default process group down before the interpreter does: left to C++ destructors at exit,
    gloo's threads can abort the process ('terminate called without an active exception')."""
    import gc

    import torch.distributed as dist

    gc.collect()  # unreachable wrappers (a DDP reducer in a Trainer <-> module cycle) let go of the group first
    if dist.is_initialized():
        dist.destroy_process_group()


def _own_command() -> list[str]:
    """The command line that started this process, so a child runs the same program."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:  # python -m pkg.module
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", name, *sys.argv[1:]]
    if not sys.argv or not sys.argv[0] or sys.argv[0] == "-c":
        raise RuntimeError(
            "devices > 1 self-spawns by re-running the program, but this one is interactive or `python -c`; "
            "allowed: a script or module (python train.py, python -m pkg, trainer fit), or launch with torchrun"
        )
    return [sys.executable, *sys.argv]


def _die_with_parent() -> None:
    """Linux: a child gets SIGKILL when rank 0 dies, so no orphan waits in a collective forever."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _error_text(err: BaseException) -> str:
    return "".join(traceback.format_exception_only(err)).strip()


def _send_to_rank_zero(data: bytes) -> None:
    for fd in _to_rank_zero:
        with contextlib.suppress(OSError):  # rank 0 is gone: it cannot report anything any more
            os.write(fd, data)


def _print_shared_errors_once() -> None:
    """In rank 0: an uncaught error that a rank it started printed already (one bug fails every rank at
    once) is one line here, not a second copy of the traceback."""
    previous = sys.excepthook

    def hook(*exc_info: Any) -> None:
        where = getattr(exc_info[1], _REPORTED_BY, None)
        if where is None:
            previous(*exc_info)
        else:
            log.error(f"failed with the same error as {where}: {_error_text(exc_info[1]).splitlines()[0]}")

    sys.excepthook = hook


class _Child:
    """A rank that `spawn_and_run` started, and the pipe on which it says it arrived and how it failed."""

    def __init__(self, rank: int, env: dict[str, str]) -> None:
        self.rank = rank
        self.settled = False  # its end was reported, or rank 0 ended it
        self._pipe, write = os.pipe()
        self.process = subprocess.Popen(
            _own_command(), env={**env, _PIPE_FD: str(write)}, pass_fds=(write,), preexec_fn=_die_with_parent
        )
        os.close(write)
        os.set_blocking(self._pipe, False)
        self._received = b""

    def fileno(self) -> int:
        return self._pipe

    def _receive(self) -> bytes:
        with contextlib.suppress(BlockingIOError):  # nothing more for now
            while chunk := os.read(self._pipe, 65536):
                self._received += chunk
        return self._received

    @property
    def arrived(self) -> bool:
        return self._receive().startswith(_ARRIVED)

    def error(self) -> str:
        """The text of the uncaught error it sent ('' if none)."""
        return self._receive().removeprefix(_ARRIVED).decode(errors="replace").strip()

    def describe(self, when: str = "") -> str:
        """How it ended, in one line: its error's first line if it sent one."""
        error, code = self.error(), self.process.returncode
        if error:
            return f"rank {self.rank} failed{when}: {error.splitlines()[0]}"
        if code < 0:
            return f"rank {self.rank} was killed by signal {-code}{when}"
        return f"rank {self.rank} exited with code {code}{when} (its error, if any, is printed above)"


def _wait_for_arrivals(children: list[_Child]) -> None:
    """Until every rank started has reached the job; one that ends first, or takes longer than
    JOIN_TIMEOUT_S, ends the job."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while pending := [c for c in children if not c.arrived]:
        ended = [c for c in pending if c.process.poll() is not None]
        if ended or time.monotonic() > deadline:
            _terminate(children)
            if ended:
                raise RuntimeError("; ".join(c.describe(" before reaching the job") for c in ended))
            raise RuntimeError(
                f"rank(s) {[c.rank for c in pending]} did not reach the job within {JOIN_TIMEOUT_S:g} s of "
                "being started (JOIN_TIMEOUT_S in trainer.core.launch)"
            )
        select.select(pending, [], [], 0.2)  # woken by a rank's message; the timeout notices a rank's end


def _job_error(err: BaseException, failed: list[_Child]) -> BaseException:
    """What rank 0 raises when its work failed and ranks it started failed too: rank 0 was most likely
    waiting for them in a collective, so theirs is the job's error, named in the last line the user sees;
    the same error as rank 0's (one bug on every rank) is rank 0's, printed once."""
    if not failed:
        return err
    same = next((c for c in failed if c.error() == _error_text(err)), None)
    if same is not None:
        setattr(err, _REPORTED_BY, f"rank {same.rank}")
        return err
    if isinstance(err, Exception):
        return RuntimeError("; ".join(c.describe() for c in failed))
    for child in failed:  # KeyboardInterrupt and the like keep their type
        log.error(child.describe())
    return err


def _failed(children: list[_Child], grace_s: float = 0.0) -> list[_Child]:
    """The ranks that ended badly and were not reported yet (waiting up to `grace_s` for them to end);
    each is returned once: the caller reports it."""
    deadline = time.monotonic() + grace_s
    failed = []
    for child in children:
        if child.settled:
            continue
        try:
            code = child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            continue
        if code != 0:
            child.settled = True
            failed.append(child)
    return failed


def _terminate(children: list[_Child]) -> None:
    """Kill the ranks still running: they wait for a rank that is gone, and their end is no error of theirs."""
    for child in children:
        if child.process.poll() is None:
            child.process.kill()
            child.settled = True
    for child in children:
        child.process.wait()


class _Watchdog(threading.Thread):
    """Rank 0's thread that ends the job when a child dies: rank 0 may be blocked in a collective that
    will never complete, so it exits the process rather than waiting for a timeout."""

    def __init__(self, children: list[_Child]) -> None:
        super().__init__(daemon=True, name="trainer-watchdog")
        self.children = children
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.2):
            if failed := _failed(self.children):
                for child in failed:
                    log.error(child.describe())
                _terminate(self.children)
                sys.stderr.flush()
                os._exit(1)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join()
