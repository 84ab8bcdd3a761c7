"""`trainer replicas`: a fault-tolerant job on one machine, for tests and demos. A lighthouse in this process,
one `torchrun --standalone` job per replica group (its own rendezvous, restarted by `--max-restarts`), each
group's output prefixed with `[replica I]`, SIGINT/SIGTERM forwarded to every group. Across machines the same
pieces are started by hand or by the scheduler (README: one torchrun per group, the lighthouse on one node)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from trainer.fault_tolerance.config import ENV, HEARTBEAT_TIMEOUT_MS
from trainer.fault_tolerance.lighthouse import start_lighthouse


@dataclass(frozen=True)
class Launch:
    """`groups` replica groups of `nproc_per_group` processes each, restarted up to `max_restarts` times per
    group, under a lighthouse on `bind` that forms a quorum from `min_replicas` live groups."""

    groups: int
    nproc_per_group: int = 1
    max_restarts: int = 0
    min_replicas: int = 1
    bind: str = "127.0.0.1"
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS
    join_timeout_ms: int = 60000

    def __post_init__(self) -> None:
        for name, minimum in (("groups", 1), ("nproc_per_group", 1), ("max_restarts", 0), ("min_replicas", 1),
                              ("heartbeat_timeout_ms", 1), ("join_timeout_ms", 1)):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(
                    f"replicas --{name.replace('_', '-')} {value!r}; allowed: an int >= {minimum}"
                )
        if self.min_replicas > self.groups:
            raise ValueError(
                f"replicas --min-replicas {self.min_replicas} exceeds --groups {self.groups}; "
                f"allowed: 1 to {self.groups}"
            )
        host, _, port = self.bind.rpartition(":")
        if not self.bind.strip() or (port.isdigit() and ":" not in host):  # the rule FaultTolerance.bind has
            raise ValueError(f"replicas --bind {self.bind!r}; allowed: a host name or IP address (no port)")

    def group_env(self, lighthouse: str, replica: int) -> dict[str, str]:
        """What group `replica`'s processes read (`FaultTolerance.from_env()`), on top of this environment."""
        values = {"lighthouse": lighthouse, "replica_id": replica, "replicas": self.groups,
                  "min_replicas": self.min_replicas, "bind": self.bind}  # fmt: skip
        return {**os.environ, **{ENV[name]: str(value) for name, value in values.items()}}

    def torchrun(self, entry: list[str]) -> list[str]:
        """One group's torchrun: a standalone rendezvous of its own (a port the system picks), restarts."""
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={self.nproc_per_group}", f"--max-restarts={self.max_restarts}", *entry]  # fmt: skip


def run_replica_groups(
    launch: Launch,
    entry: Callable[[int, str], list[str]],
    out: IO[str] = sys.stdout,
    err: IO[str] = sys.stderr,
) -> int:
    """Start the lighthouse and every group (`entry(replica, lighthouse)`: what follows torchrun's options),
    wait for all of them, stop the lighthouse. 0 when every group finished; otherwise one line naming the
    groups that failed for good (or the signal that stopped the job) and a non-zero status."""
    server = start_lighthouse(f"{launch.bind}:0", launch.min_replicas, launch.heartbeat_timeout_ms,
                              launch.join_timeout_ms)  # fmt: skip
    # torchft reports the machine's host name; the groups dial the address it listens on
    lighthouse = f"{launch.bind}:{server.address().rpartition(':')[2]}"
    print(f"replicas: lighthouse listening on http://{lighthouse}", file=out, flush=True)
    procs: list[subprocess.Popen] = []
    stopped: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopped.append(signum)
        for proc in procs:  # torchrun stops its workers on SIGINT/SIGTERM and exits
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    copiers: list[threading.Thread] = []
    errors = [LastError() for _ in range(launch.groups)]
    try:
        for replica in range(launch.groups):
            if stopped:
                break
            # a session of its own: a terminal's Ctrl-C reaches the groups once, through `forward`
            proc = subprocess.Popen(launch.torchrun(entry(replica, lighthouse)), env=launch.group_env(lighthouse, replica),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
            procs.append(proc)
            for pipe, sink, seen in ((proc.stdout, out, None), (proc.stderr, err, errors[replica])):
                copiers.append(
                    threading.Thread(
                        target=_prefixed, args=(pipe, sink, f"[replica {replica}] ", seen), daemon=True
                    )
                )
                copiers[-1].start()
        codes = [proc.wait() for proc in procs]
    finally:
        for proc in procs:  # only when this process itself failed: no group outlives the launcher
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for thread in copiers:
            thread.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.shutdown()
    line, status = _summary(launch, codes, stopped)
    print(f"replicas: {line}", file=err if status else out, flush=True)
    if status and not stopped:  # last, what each failed group said ended it: the line the user reads
        for replica, code in enumerate(codes):
            if code != 0 and errors[replica].line is not None:
                print(f"replicas: replica group {replica}: {errors[replica].line}", file=err, flush=True)
    return status


def _summary(launch: Launch, codes: list[int], stopped: list[int]) -> tuple[str, int]:
    """One line on how the job ended, and the launcher's exit status."""
    if stopped:
        name = signal.Signals(stopped[0]).name
        return f"stopped by {name}, forwarded to every replica group (exit statuses {codes})", 128 + stopped[
            0
        ]
    failed = [(replica, code) for replica, code in enumerate(codes) if code != 0]
    if not failed:
        return f"{launch.groups} replica group(s) finished", 0
    names = ", ".join(f"replica group {replica} (torchrun exit {code})" for replica, code in failed)
    return (
        f"{names} failed for good after up to --max-restarts={launch.max_restarts} restart(s); "
        f"{launch.groups - len(failed)} of {launch.groups} finished (see the lines prefixed [replica I])",
        1,
    )


class LastError:
    """The last error a group's processes printed on stderr: a `trainer: error: ...` line, or the line that
    ends a Python traceback (the exception, the last of a chain) except torchrun's own ChildFailedError,
    which only says that a worker failed."""

    def __init__(self) -> None:
        self.line: str | None = None
        self._in_traceback = False

    def see(self, line: str) -> None:
        """Read the next line of the group's stderr."""
        line = re.sub(r"^\[rank\d+\]: ", "", line)  # torchrun's tag on a worker's uncaught error
        if line.startswith("Traceback (most recent call last):"):
            self._in_traceback = True
        elif line.startswith(CLI_ERROR):
            self.line = line.removeprefix(CLI_ERROR)
        elif self._in_traceback and line[:1] not in ("", " ", "\t"):  # the frames are indented
            self._in_traceback = False
            if not line.startswith(TORCHRUN_FAILED):
                self.line = re.sub(r"^(\w+\.)+(?=\w+: )", "", line)  # the class, not its module path


CLI_ERROR = "trainer: error: "
TORCHRUN_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def _prefixed(pipe: IO[bytes], sink: IO[str], prefix: str, seen: LastError | None = None) -> None:
    """Copy a group's output line by line, each prefixed with the group, until the group closes it; `seen`
    reads each line too."""
    for raw in iter(pipe.readline, b""):
        text = raw.decode(errors="replace")
        # a progress bar redraws its line after a carriage return: the redrawn line keeps the prefix
        sink.write(prefix + re.sub(r"\r(?!\n)", "\r" + prefix, text))
        sink.flush()
        if seen is not None:
            seen.see(text.rstrip("\r\n").rpartition("\r")[2])
    pipe.close()
