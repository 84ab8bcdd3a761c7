"""Test processes forked from a preloaded interpreter. A server per pytest process imports torch, this
project and torch's distributed parts once; each `python SCRIPT ARGS`, `python -m MODULE ARGS` or `python -c
CODE ARGS` a test starts through it is a fork that runs as that command would (its argv, environment,
working directory, file descriptors, exit code, atexit handlers) without the ~2.5 CPU-s of imports a fresh
interpreter pays on this machine: most of what the multi-process tests cost (tests/helpers.py `run_ranks`).

They are real processes in real gloo groups; only the imports are shared. What a fork would change is
kept on fresh interpreters: a different import-time environment (IMPORT_TIME), one launch of each kind as a
user starts it (`fresh` in tests/helpers.py), and the tests of start-up itself. A process a launcher starts
(LAUNCHERS: torchrun's agent, `trainer replicas`, the self-spawn) is forked too. Under pytest-xdist the
controller starts one server that its workers share (`start_shared`), and the workers are forks of it too
(tests/xdist_fork.py). Run as `python tests/preloaded.py SOCKET [LOCK_FD]`, this file is the server."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gc
import importlib
import io
import json
import locale
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any

# what a rank script, `trainer fit` or a DDP/FSDP/3D rank imports before its first step, then what the Hugging
# Face and Lightning scripts import (in forks, ~5% of the suite's CPU went to importing these again)
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch.distributed.run",
    "trainer",
    "trainer.cli",
    "strategies",
    "callbacks",
    # imported lazily, after the packages above, by nearly every rank and `trainer fit` (~30 ms of a fork's CPU)
    "trainer.trainer",
    "trainer.models.causal_lm",
    "strategies.checkpoint_io.dcp_files",
    "torch.distributed.algorithms.ddp_comm_hooks",
    "torchft",  # the fault-tolerance ranks and lighthouses (~0.1 CPU-s each; it starts no thread)
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.bert.modeling_bert",
    "datasets",
    "torchmetrics",
    "pytorch_lightning",
)
# variables read while those modules import (thread pools, allocators, torch's and the HF hub's flags and
# cache folders, the import path, torchft's Rust log level): a command whose values differ from the server's
# gets a fresh interpreter
IMPORT_TIME = (
    "TORCH_", "TORCHDYNAMO", "TORCHINDUCTOR", "PYTORCH", "OMP_", "MKL", "KMP_", "OPENBLAS", "PYTHON", "LD_",
    "CUDA", "NCCL", "GLOO", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "MALLOC", "GLIBC", "XDG_",
    "RUST_LOG",
)  # fmt: skip
# ... but read only when used, or by what torch does not load: set by torch (the inductor cache's location),
# Lightning (how to look for CUDA), scikit-learn's import (for Intel's OpenMP; torch's CPU build loads GNU's)
# and torchrun's agent (read as an NCCL group is made) in a process before it starts others
RUNTIME_READ = {
    "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK", "KMP_DUPLICATE_LIB_OK", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}  # fmt: skip
LOG = "TRAINER_TEST_PRELOAD_LOG"  # a file: each launch, and whether it was forked (else why not), appended
_LENGTH = struct.Struct("!I")
_MAX_FDS = 16


# ---- the client: what a test (or a rank that starts other ranks) uses ------------------------------
class Server:
    """The preloading server this process started (once), with the environment it imported under. `shared`:
    started for other processes (pytest-xdist's workers, `start_shared`), which wait for it (`Shared`): this
    one goes on without waiting for its imports."""

    def __init__(self, env: dict[str, str], shared: bool = False) -> None:
        self.folder = tempfile.mkdtemp(prefix="preload-")
        self.path = os.path.join(self.folder, "socket")
        self.env = dict(env)
        lock = None
        if shared:
            Path(self.folder, _ENV_FILE).write_text(json.dumps(self.env))
            lock = os.open(os.path.join(self.folder, _READY_LOCK), os.O_RDWR | os.O_CREAT)
            fcntl.flock(lock, fcntl.LOCK_EX)  # the server's inherited copy holds it until the socket listens
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.path, *([str(lock)] if shared else [])],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL if shared else subprocess.PIPE,
            pass_fds=() if lock is None else (lock,),
            preexec_fn=_die_with_parent,
        )
        atexit.register(self.stop)
        if lock is not None:
            os.close(lock)
            return
        ready = self.process.stdout.readline()  # written once the imports are done and the socket listens
        if ready.strip() != b"ready":
            raise RuntimeError(f"the preloading server did not start (exit {self.process.wait()})")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


class Shared:
    """A server another process started for this one (`start_shared`, at SHARED): its socket and the
    environment it imported under, once it listens (until then it holds the folder's lock)."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, "socket")
        self.env = json.loads(Path(folder, _ENV_FILE).read_text())
        lock = os.open(os.path.join(folder, _READY_LOCK), os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_SH)  # granted once the server listens, or has died
        finally:
            os.close(lock)
        if not os.path.exists(self.path):
            raise RuntimeError(f"the shared preloading server at {folder} did not start (its error is above)")


def start_shared(env: dict[str, str]) -> None:
    """Start this process's server for the processes it starts (pytest-xdist's workers, whose `server` then
    returns it): one interpreter's imports (~8 CPU-s) instead of one per worker. Returns at once."""
    os.environ[SHARED] = server(env, shared=True).folder


def fork_blockers(cmd: list[str], env: dict[str, str], server_env: dict[str, str]) -> list[str]:
    """What keeps `cmd` with `env` from running the same forked from a server that imported under
    `server_env` as in a fresh interpreter ([] when nothing does): not a Python script or module, or the
    import-time variables that differ. Python's -u (torchrun gives it its workers) may come first."""
    python = len(cmd) >= 2 and cmd[0] == sys.executable
    program = list(cmd[2:] if python and cmd[1] == "-u" else cmd[1:])
    if not (
        python
        and program
        and (program[0].endswith(".py") or (program[0] in ("-m", "-c") and len(program) >= 2))
    ):
        return ["not `python [-u] SCRIPT.py`, `python [-u] -m MODULE` or `python [-u] -c CODE`"]
    keys = {k for k in (*env, *server_env) if read_at_import(k)}
    return sorted(k for k in keys if env.get(k) != server_env.get(k))


def read_at_import(key: str) -> bool:
    """Whether the environment variable `key` is one that importing PRELOAD reads (IMPORT_TIME, less
    RUNTIME_READ)."""
    return key.startswith(IMPORT_TIME) and key not in RUNTIME_READ


_server: list[Server | Shared] = []
_SERVER_PATH = "TRAINER_TEST_PRELOAD_SOCKET"  # set in a forked process: where to start further ones
SHARED = "TRAINER_TEST_PRELOAD_SHARED"  # the folder of a server a parent process started for this one
_ENV_FILE, _READY_LOCK = "env.json", "ready.lock"  # in a shared server's folder


def server(env: dict[str, str], shared: bool = False) -> Server | Shared:
    """This process's server: the one its parent shares (SHARED), else one started on first use with `env`
    as its import-time environment (`shared`: see Server)."""
    if not _server:
        folder = os.environ.get(SHARED)
        _server.append(Shared(folder) if folder and not shared else Server(env, shared))
    return _server[0]


class PreloadedProcess:
    """`cmd` forked from the server at `path`: as much of subprocess.Popen as the tests, trainer/core/launch.py,
    `trainer replicas`, torchrun's agent and the benches use (pid, returncode, stdout, stderr, poll, wait,
    communicate, kill, terminate, send_signal); `wait` and `poll` may be called from two threads, as Popen's."""

    def __init__(
        self,
        path: str,
        cmd: list[str],
        env: dict[str, str],
        cwd: str,
        fds: dict[int, int],
        session: bool = False,
        pipes: dict[int, int] | None = None,
        text: bool = False,
        plain: bool = False,
    ) -> None:
        """`session`: the command leads a new session (Popen's start_new_session), as it starts; `pipes`: the
        read ends of pipes the command writes its fd 1 or 2 to (Popen's PIPE), kept as `stdout` and `stderr`;
        `plain`: the processes the command starts are never forks (a pytest-xdist worker:
        tests/xdist_fork.py)."""
        self.args = cmd
        self.returncode: int | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        request = {
            "argv": list(cmd[1:]),
            "env": env,
            "cwd": cwd,
            "fds": list(fds),
            "session": session,
            "plain": plain,
        }
        data = json.dumps(request).encode()
        socket.send_fds(self._sock, [_LENGTH.pack(len(data)) + data], list(fds.values()))
        self._buffer = b""
        self._lock = threading.Lock()  # one reader of the socket at a time
        self._text = text
        self._read = {1: b"", 2: b""}
        pipes = pipes or {}
        self.stdout, self.stderr = (
            os.fdopen(pipes[fd], "r" if text else "rb") if fd in pipes else None for fd in (1, 2)
        )
        self.pid = int(self._line(None))

    def fileno(self) -> int:
        """Readable when the process has ended (select on it; -1 once `returncode` is known)."""
        return self._sock.fileno()

    def _line(self, timeout: float | None) -> str | None:
        while b"\n" not in self._buffer:
            if not select.select([self._sock], [], [], timeout)[0]:
                return None
            chunk = self._sock.recv(64)
            if not chunk:
                raise RuntimeError(f"the preloading server lost process {self.args[1:3]}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):  # else another thread waits
            try:
                if self.returncode is None and (line := self._line(0)) is not None:
                    self._ended(line)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.returncode is None:
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            try:
                if self.returncode is None:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    line = self._line(left)
                    if line is None:
                        raise subprocess.TimeoutExpired(self.args, timeout)
                    self._ended(line)
            finally:
                self._lock.release()
        return self.returncode

    def _ended(self, line: str) -> None:
        self.returncode = int(line)
        self._sock.close()

    def communicate(self, timeout: float | None = None) -> tuple[str | bytes | None, str | bytes | None]:
        """As Popen.communicate (no input): all the command wrote to each pipe, once it has closed them and
        ended; past `timeout`, TimeoutExpired, and a later call goes on reading."""
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = {
            f.fileno(): (fd, f) for fd, f in ((1, self.stdout), (2, self.stderr)) if f and not f.closed
        }
        while streams:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select(list(streams), [], [], left)[0]
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for raw in ready:
                fd, stream = streams[raw]
                if chunk := os.read(raw, 1 << 16):
                    self._read[fd] += chunk
                else:
                    stream.close()
                    del streams[raw]
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._output(1, self.stdout), self._output(2, self.stderr)

    def _output(self, fd: int, stream: object) -> str | bytes | None:
        if stream is None:
            return None
        if not self._text:
            return self._read[fd]
        text = self._read[fd].decode(locale.getpreferredencoding(False))
        return text.replace("\r\n", "\n").replace("\r", "\n")  # text mode's universal newlines

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def popen(
    cmd: list[str], env: dict[str, str], cwd: str, fds: dict[int, int], server_env: dict[str, str]
) -> PreloadedProcess | subprocess.Popen:
    """`cmd` forked from this process's server (started with `server_env` the first time) when it runs the
    same there (no `fork_blockers`), else in a fresh interpreter; `fds`: the command's descriptor -> this
    process's (0, 1 and 2 at least)."""
    found = server(server_env)
    blockers = fork_blockers(cmd, env, found.env)
    _log(cmd, blockers)
    if not blockers:
        return PreloadedProcess(found.path, cmd, env, cwd, fds)
    return subprocess.Popen(
        cmd, env=env, cwd=cwd, stdin=fds[0], stdout=fds[1], stderr=fds[2],
        pass_fds=[fd for target, fd in fds.items() if target > 2], preexec_fn=_die_with_parent,
    )  # fmt: skip


def spawn(cmd: list[str], server_env: dict[str, str], **kwargs: Any) -> PreloadedProcess | subprocess.Popen:
    """subprocess.Popen(cmd, **kwargs), forked from this process's server (started with `server_env` the
    first time) when it runs the same there and a fork takes those arguments (`_start`)."""
    found = server(server_env)
    proc = _start(found.path, found.env, cmd, kwargs)
    return proc if proc is not None else subprocess.Popen(cmd, **kwargs)


def _log(cmd: list[str], blockers: list[str]) -> None:
    if os.environ.get(LOG):
        with open(os.environ[LOG], "a") as log:
            log.write(f"{list(cmd[1:3])} {'forked' if not blockers else f'fresh: {blockers}'}\n")


# the modules that start processes a fork may run: trainer/core/launch.py's self-spawn and Lightning's (copies of
# their own command), `trainer replicas` (torchrun per group) and torchrun's agent (its workers); a script
# that starts its own file again, as the benches start their arms, is one too (see `_launcher`)
LAUNCHERS = (
    "trainer.core.launch",
    "trainer.fault_tolerance.launch",
    "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",
    "lightning_fabric.strategies.launchers.subprocess_script",
    "pytorch_lightning.strategies.launchers.subprocess_script",
)
# the Popen arguments a fork takes (the streams: see `_streams`; preexec_fn: each launcher's is a death
# signal, which a fork has from its middle process)
_FORWARDED = {"env", "cwd", "pass_fds", "preexec_fn", "stdout", "stderr", "text", "start_new_session"}


def _launcher(caller: dict, args: list[str]) -> bool:
    """Whether the module whose globals are `caller` is one of LAUNCHERS, or a script that runs its own file
    (`python SCRIPT ...` from SCRIPT)."""
    script = caller.get("__file__")
    own = caller.get("__name__") == "__main__" and script and len(args) > 1
    return caller.get("__name__") in LAUNCHERS or bool(
        own and os.path.abspath(args[1]) == os.path.abspath(script)
    )


def _start(path: str, server_env: dict[str, str], cmd: list[str], kwargs: dict) -> PreloadedProcess | None:
    """subprocess.Popen(cmd, **kwargs) forked from the server at `path`, which imported under `server_env`;
    None when it would not run the same there (`fork_blockers`) or a fork does not take those arguments."""
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    if set(kwargs) - _FORWARDED:
        return None
    blockers = fork_blockers(list(cmd), env, server_env)
    _log(cmd, blockers)
    streams = None if blockers else _streams(kwargs.get("stdout"), kwargs.get("stderr"))
    if streams is None:
        return None
    std, pipes, ours = streams
    fds = {0: 0, **std, **{fd: fd for fd in kwargs.get("pass_fds", ())}}
    cwd = str(kwargs.get("cwd") or os.getcwd())
    session, text = bool(kwargs.get("start_new_session")), bool(kwargs.get("text"))
    try:
        return PreloadedProcess(path, list(cmd), env, cwd, fds, session, pipes, text)
    finally:
        for fd in ours:
            os.close(fd)  # the command holds its own copies now


def _streams(stdout: object, stderr: object) -> tuple[dict[int, int], dict[int, int], list[int]] | None:
    """A fork's fds 1 and 2 for Popen's `stdout` and `stderr` (None: this process's; PIPE: a new pipe;
    DEVNULL; for stderr, STDOUT; a descriptor or a file), the read ends of the pipes by fd, and what was
    opened here for the command; None for anything else."""
    for fd, spec in ((1, stdout), (2, stderr)):
        named = spec is None or hasattr(spec, "fileno") or (isinstance(spec, int) and spec >= 0)
        special = spec in (subprocess.PIPE, subprocess.DEVNULL) or (fd == 2 and spec == subprocess.STDOUT)
        if not (named or special):
            return None
    std: dict[int, int] = {}
    pipes: dict[int, int] = {}
    ours: list[int] = []
    for fd, spec in ((1, stdout), (2, stderr)):
        if spec is None:
            std[fd] = fd
        elif spec == subprocess.PIPE:
            pipes[fd], std[fd] = os.pipe()
            ours.append(std[fd])
        elif spec == subprocess.DEVNULL:
            std[fd] = os.open(os.devnull, os.O_WRONLY)
            ours.append(std[fd])
        elif spec == subprocess.STDOUT:
            std[fd] = std[1]
        else:
            std[fd] = spec if isinstance(spec, int) else spec.fileno()
    return std, pipes, ours


def _forking_popen(server_env: dict[str, str]) -> type[subprocess.Popen]:
    """subprocess.Popen for a forked process: a command a launcher (`_launcher`) starts is forked from the
    server too (`_start`); every other process starts as usual."""

    class ForkingPopen(subprocess.Popen):
        def __new__(cls, args, *rest, **kwargs):
            proc = None
            if not rest and _launcher(sys._getframe(1).f_globals, args):
                proc = _start(os.environ[_SERVER_PATH], server_env, args, kwargs)
            return proc if proc is not None else super().__new__(cls)

    return ForkingPopen


# ---- the server ------------------------------------------------------------------------------------
def serve(path: str, lock: int | None = None) -> None:
    """Import PRELOAD, listen at `path` (then let go of `lock`, the descriptor of a shared server's ready
    lock), fork each request (see `_run`) until killed."""
    for name in PRELOAD:
        importlib.import_module(name)
    _rendezvous_names_from_the_frame()
    # the imports' ~300,000 objects out of the collector's reach: else each fork's full collections (one in
    # every rank's exit, trainer/core/launch.py destroy_process_group) walk them all, ~0.3 CPU-s and ~20,000 pages
    # copied per fork; measured in a fork, 0.30 s -> 0.00 s
    gc.collect()
    gc.freeze()
    env = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    if lock is not None:
        os.close(lock)  # the last holder of the lock its starter took: the waiting processes connect now
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the middle processes
    held = {int(fd) for fd in os.listdir("/proc/self/fd")}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    while True:
        conn, _ = listener.accept()
        request, fds = _receive(conn)
        if os.fork() == 0:
            listener.close()
            _middle(conn, request, fds, env, path, held)
        conn.close()
        for fd in fds:
            os.close(fd)


def _rendezvous_names_from_the_frame() -> None:
    """torchrun's rendezvous names each event it records after the method that recorded it, found with
    `inspect.stack()`, which resolves every frame's module; a frame of no module (runpy's, this server's once a
    fork replaced `__main__`) scans all of sys.modules, ~4,500 here against a plain torchrun's ~1,200, three
    times a frame: ~0.75 CPU-s of each forked launch (agent and ranks: 1.15 -> 0.39). The same name, read off
    the frame."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # inspect.stack()[depth].function, as torch's
        except ValueError:  # a stack that shallow
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, _MAX_FDS)
    while len(data) < _LENGTH.size or len(data) < _LENGTH.size + _LENGTH.unpack_from(data)[0]:
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("a request ended early")
        data += chunk
    return json.loads(data[_LENGTH.size :]), list(fds)


def _middle(conn: socket.socket, request: dict, fds: list[int], env: dict, path: str, held: set) -> None:
    """Between the server and the command: forks it, sends its pid, then its exit code when it ends; kills
    it when the client goes away first (as PR_SET_PDEATHSIG does a rank whose rank 0 died)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    started, child_started = os.pipe()
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.close(started)
        if request["session"]:
            os.setsid()
        os.close(child_started)
        _run(request, fds, env, path, held)
    for fd in fds:
        os.close(fd)
    # the pid goes out once the command leads its session, as Popen returns after start_new_session took
    # effect: torchrun's agent may killpg it at once
    os.close(child_started)
    os.read(started, 1)
    os.close(started)
    with contextlib.suppress(OSError):
        conn.sendall(f"{pid}\n".encode())
    ended = os.pidfd_open(pid)
    watch = [conn, ended]
    while ended not in select.select(watch, [], [])[0]:
        if not conn.recv(64):  # the client is gone
            watch.remove(conn)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    # its exit status with the process left unreaped until the client has read it: a zombie still holds its
    # process group, which torchrun's agent may killpg while the worker's poll() still says running (a
    # reaped one's is gone: ProcessLookupError, and the agent died instead of restarting the group)
    ended_as = os.waitid(os.P_PIDFD, ended, os.WEXITED | os.WNOWAIT)
    code = ended_as.si_status if ended_as.si_code == os.CLD_EXITED else -ended_as.si_status
    with contextlib.suppress(OSError):
        conn.sendall(f"{code}\n".encode())
        while conn.recv(64):  # the client closes the connection once it has the code (or is gone)
            pass
    os.waitpid(pid, 0)
    os._exit(0)


def _run(request: dict, fds: list[int], server_env: dict, path: str, held: set) -> None:
    """In the fork: the command's descriptors, directory and environment, then its program, then exit as
    the interpreter does (threads joined, atexit handlers, streams flushed)."""
    code = 1
    try:
        moved = [_high(fd) for fd in fds]
        for target, fd in zip(request["fds"], moved, strict=True):
            if target > 2 and target in held:
                raise RuntimeError(f"fd {target} is the server's; allowed: a descriptor it does not hold")
            os.dup2(fd, target)
        for fd in moved:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if not request["plain"]:
            os.environ[_SERVER_PATH] = path
            forking = _forking_popen(server_env)
            for module in (sys.modules.get(name) for name in LAUNCHERS):
                if getattr(module, "Popen", None) is subprocess.Popen:  # `from subprocess import Popen`
                    module.Popen = forking
            subprocess.Popen = forking
        code = _main(request["argv"])
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _high(fd: int) -> int:
    """`fd` moved above the descriptors a command is given (fds 0-2 and its pass_fds)."""
    import fcntl

    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 200)
    os.close(fd)
    return high


def _main(argv: list[str]) -> int:
    """Run `python ARGV` in this process as the interpreter would; its exit code."""
    import runpy

    if argv[0] == "-u":
        _unbuffered()
        argv = argv[1:]
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""  # as Python's -c: the working directory
            exec(compile(argv[1], "<string>", "exec", dont_inherit=True), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            sys.modules.pop(argv[1], None)  # preloaded, but a fresh `python -m` runs it as __main__ only
            runpy._run_module_as_main(argv[1], alter_argv=True)
        else:
            script = Path(argv[0])
            sys.argv = list(argv)
            sys.path[0] = str(script.resolve().parent)
            main.__file__ = os.path.abspath(script)
            exec(compile(script.read_bytes(), main.__file__, "exec", dont_inherit=True), main.__dict__)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # the interpreter's order at exit: non-daemon threads, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def _unbuffered() -> None:
    """Python's -u: sys.stdout and sys.stderr write through to their descriptors at every write."""
    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        old.flush()
        raw = io.FileIO(old.fileno(), "w", closefd=False)
        stream = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors, write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _die_with_parent() -> None:
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


if __name__ == "__main__":
    sys.path[0] = os.path.dirname(
        sys.argv[1]
    )  # not tests/ (nothing to import there); each command sets its own
    serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
