"""Process launching: find the world a process belongs to (torchrun, SLURM) or start it (self-spawn).

Self-spawn re-executes the user's own command (the script, `python -m pkg`, or `trainer fit ...`) for
local ranks 1..N-1 with torchrun's environment variables, and this process becomes rank 0, as
Lightning's subprocess launcher does. Chosen over torch's elastic agent API because the agent runs the
work in child processes only: the user's process would return from `fit` holding an untrained model,
and every object given to `fit` would have to be picklable. With re-execution nothing is pickled and
the code after `fit` runs in each rank, as it does under torchrun. A watchdog thread in rank 0 ends the
whole job as soon as any child dies (an exception or a SIGKILL), and children die with rank 0.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.logging import log

_REPORTED_BY = "_trainer_reported_by"  # attribute on an exception: which rank prints its traceback


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


def spawn_and_run(nprocs: int, function: Callable[..., Any], *args: Any) -> Any:
    """Start local ranks 1..nprocs-1 as copies of this command, become rank 0, run `function`.

    Rank 0 binds its TCPStore on port 0 before starting the others and hands them the port the system
    chose: no window in which another process can take a port that was found free but not yet bound."""
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
        subprocess.Popen(
            _own_command(),
            env={**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r)},
            preexec_fn=_die_with_parent,
        )
        for r in range(1, nprocs)
    ]
    watchdog = _Watchdog(children)
    watchdog.start()
    # ranks 1..N-1 run the rest of the program too (collectives included): rank 0 waits for them at exit
    atexit.register(_wait_for_children, children, watchdog)
    try:
        return function(*args)
    except BaseException:
        watchdog.stop()
        _report_dead(children, watchdog.reported, grace_s=1.0)  # a dead child is usually why rank 0 failed
        _terminate(children)
        raise


def _wait_for_children(children: list[subprocess.Popen], watchdog: _Watchdog) -> None:
    """At rank 0's exit: wait for the other ranks; the job fails if one of them failed."""
    watchdog.stop()
    for child in children:
        child.wait()
    destroy_process_group()  # after the children: rank 0 hosts the store they use until the end
    if _report_dead(children, watchdog.reported):
        sys.stderr.flush()
        os._exit(1)


def exit_quietly_when_done() -> None:
    """For a rank that `spawn_and_run` started: end the process right after the atexit handlers, before
    the interpreter's finalisation, with 1 after an uncaught exception and 0 otherwise.

    Why: if a gloo process group still has worker threads when Python finalises (FSDP2/DTensor keep
    references to it), a thread that needs the GIL is force-unwound and the process aborts
    ('terminate called without an active exception', seen in about 1 of 25 FSDP runs here). Rank 0 then
    reports a failure for a run that finished. Registered before `destroy_process_group`, so it runs after.
    """
    failed = []
    previous = sys.excepthook

    def hook(*exc_info: Any) -> None:
        failed.append(True)
        where = getattr(exc_info[1], _REPORTED_BY, None)
        if where is None:
            previous(*exc_info)
        else:  # the same error's traceback is printed by `where`: one line here, not a second copy
            summary = "".join(traceback.format_exception_only(exc_info[1])).strip().splitlines()[-1]
            log.error(f"failed with the same error as {where}: {summary}")

    sys.excepthook = hook

    def finish() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if failed else 0)

    atexit.register(finish)


def take_spawned_store() -> Any:
    """The TCPStore `spawn_and_run` bound for this rank 0, once; None in any other process."""
    return _spawned_store.pop() if _spawned_store else None


def mark_reported_elsewhere(err: BaseException, where: str) -> None:
    """Tell this spawned rank's exit hook that `where` prints `err`'s traceback, so it prints one line."""
    setattr(err, _REPORTED_BY, where)


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


def _report_dead(children: list[subprocess.Popen], reported: set[int], grace_s: float = 0.0) -> bool:
    """Log each child that ended badly, once (ranks in `reported` were logged already); True if one did."""
    deadline = time.monotonic() + grace_s
    dead = False
    for rank, child in enumerate(children, start=1):
        try:
            code = child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            continue
        if code != 0:
            if rank not in reported:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                log.error(f"rank {rank} {how}; ending the job (its error, if any, is printed above)")
                reported.add(rank)
            dead = True
    return dead


def _terminate(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.kill()
    for child in children:
        child.wait()


class _Watchdog(threading.Thread):
    """Rank 0's thread that ends the job when a child dies: rank 0 may be blocked in a collective that
    will never complete, so it exits the process rather than waiting for a timeout."""

    def __init__(self, children: list[subprocess.Popen]) -> None:
        super().__init__(daemon=True, name="trainer-watchdog")
        self.children = children
        self.reported: set[int] = set()  # ranks already logged as dead (by this thread or after it stopped)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.2):
            if _report_dead(self.children, self.reported):
                _terminate(self.children)
                sys.stderr.flush()
                os._exit(1)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join()
