"""`FaultTolerance`: where a replica group finds the lighthouse, who it is, and how long it waits."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# what `trainer replicas` (and torchft's own TorchX launcher) tells each replica group's processes
ENV = {
    "lighthouse": "TORCHFT_LIGHTHOUSE",
    "replica_id": "REPLICA_GROUP_ID",
    "replicas": "NUM_REPLICA_GROUPS",
    "min_replicas": "TRAINER_FT_MIN_REPLICAS",
    "bind": "TRAINER_FT_BIND",
}
# A crashed group's process stops heartbeating at once; the lighthouse forms the survivors' next quorum when
# its last heartbeat is HEARTBEAT_TIMEOUT_MS old (their stall after a crash, the step in flight having failed
# on the closed connection already). A live group heartbeats every HEARTBEAT_INTERVAL_MS (a thread of
# torchft's manager server, which a busy or hung Python thread does not hold up): it would miss five in a row
# before it reads as dead. A stopped process or a lost machine or network is caught the same way; a hang
# inside a collective by `timeout_s`. Each heartbeat is a gRPC call (~0.3 ms CPU at each end here): at 50 ms
# (and tokio's default threads below), two groups' managers and their lighthouse took 1.5% of the job's CPU
# (perf, bench width 1024, groups of 2 DDP processes; 0.6% now)
HEARTBEAT_INTERVAL_MS = 100
HEARTBEAT_TIMEOUT_MS = 500
# the lighthouse re-checks a quorum that waits (for a heartbeat to run out) this often
QUORUM_TICK_MS = 25
# the async runtime threads of a group's torchft manager (server and client, every process of the group):
# tokio's default is one per core, for a control plane of a few calls per step; with one, a call's hops stay
# on one thread (bench MLP width 256: a group's torchft threads wake 6 times a step, not 12). torchft's handlers
# only await, never block. The lighthouse (it serves every group of a job) keeps tokio's default
TOKIO_WORKERS = 1
# the longest wait a timeout may name: beyond it is a typo, and torchft's millisecond timeouts overflow
WEEK_S = 7 * 24 * 3600


@dataclass(frozen=True)
class FaultTolerance:
    """Per-step fault tolerance over replica groups (torchft): this process's group is `replica_id` of
    `replicas` planned groups, coordinated by the lighthouse at `lighthouse` ("host:port").

    Each step forms a quorum of the live groups; a step commits when at least `min_replicas` took part.
    `timeout_s` bounds a step's collectives, its commit vote and a live recovery; `quorum_timeout_s` is how
    long a step waits for a quorum before the fit ends with an error (the lighthouse, started with
    `--min-replicas` = `min_replicas`, forms none while fewer groups are alive). This group's
    servers (its torchft manager and store) listen on `bind` only, the address peers reach it at:
    127.0.0.1 keeps a job on one machine; a multi-node job names the node's address.

    `sync_every` > 1 is DiLoCo (outer_sync.py): the groups train apart and meet every `sync_every` steps,
    where an outer SGD (`outer_lr`, Nesterov `outer_momentum`; the paper's 0.7 and 0.9, for windows of
    hundreds of steps) steps the averaged pseudo-gradient; the quorum (and a recovery) happens at those
    meetings only. For short windows (tens of steps) take `outer_lr=1.0, outer_momentum=0.0` (parameter
    averaging): the momentum compounds into a step of up to lr/(1-momentum) = 7x (bench/diloco.py at k=8:
    1.045x per-step sync's loss, the paper's 1.37x). `sync_optimizer_state` also averages the inner
    optimizer's moments at each meeting (3x the bytes of a meeting; k=8: 1.034x). `sync_warmup_steps`
    runs the first steps as per-step sync (gradients averaged every step, as the paper's DiLoCo starts from a
    synchronously trained checkpoint), the windows after: a multiple of `sync_every`, so windows stay on
    multiples of it; one covering the whole run is per-step sync (k=8, a quarter of the run, with
    `sync_optimizer_state`: 1.018-1.027x over 3 seeds). `sync_combined_second_moment` (with
    `sync_optimizer_state`; an Adam-family optimizer) then sets the averaged second moment to that of the
    groups' combined batch, m^2 + (v - m^2) / groups (outer_sync.combine_second_moment): each group's v holds
    its own smaller batch's noise, which made its inner steps smaller than per-step sync's where noise
    dominates (k=8, with both the above: 1.001-1.017x over 3 seeds, within the 2% target; without the
    warm-up it hurts: 1.051x against 1.026x).

    `quorum_every` > 1 (per-step sync; groups of one process, or of DDP or FSDP2 ranks whose backward
    averages over the groups): a quorum every that many steps while the
    groups stay in step, instead of every step (cadence.py): a short step's per-step cost drops (bench MLP
    width 256: 1.12-1.26x plain DDP to 1.01-1.14x at 8); a dead peer is still caught by the step's all-reduce,
    a group's own skip by a flag summed with the gradients (every group then discards the next step and
    takes a quorum), and a group that joins waits at most that many steps for the others' quorum, or
    `max_quorum_interval_s` (and two steps) where they take longer (keep the lighthouse's join timeout, 60 s
    by default, above it: past it the joiner's quorum forms without the others).
    """

    lighthouse: str
    replica_id: int
    replicas: int = 2
    min_replicas: int = 1
    timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
    bind: str = "127.0.0.1"
    sync_every: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    sync_optimizer_state: bool = False
    sync_warmup_steps: int = 0
    sync_combined_second_moment: bool = False
    quorum_every: int = 1
    max_quorum_interval_s: float = 10.0

    def __post_init__(self) -> None:
        _host_port("lighthouse", self.lighthouse)
        _int("replicas", self.replicas, 1)
        _int("replica_id", self.replica_id, 0)
        if self.replica_id >= self.replicas:
            raise ValueError(
                f"FaultTolerance replica_id={self.replica_id} with replicas={self.replicas}; allowed: 0 to {self.replicas - 1}"
            )
        _int("min_replicas", self.min_replicas, 1)
        _int("sync_every", self.sync_every, 1)
        _int("quorum_every", self.quorum_every, 1)
        if self.quorum_every > 1 and self.sync_every > 1:
            raise ValueError(
                f"FaultTolerance quorum_every={self.quorum_every} with sync_every={self.sync_every}; allowed: "
                "one of them above 1 (DiLoCo's groups take a quorum at their meetings only)"
            )
        if not isinstance(self.sync_optimizer_state, bool):
            raise ValueError(
                f"FaultTolerance sync_optimizer_state={self.sync_optimizer_state!r}; allowed: True or False"
            )
        if self.sync_optimizer_state and self.sync_every == 1:
            raise ValueError(
                "FaultTolerance sync_optimizer_state=True with sync_every=1; allowed: sync_every > 1 (DiLoCo, "
                "whose meetings average the optimizer state; per-step sync has no local state to average)"
            )
        if not isinstance(self.sync_combined_second_moment, bool):
            raise ValueError(
                f"FaultTolerance sync_combined_second_moment={self.sync_combined_second_moment!r}; allowed: True or False"
            )
        if self.sync_combined_second_moment and not self.sync_optimizer_state:
            raise ValueError(
                "FaultTolerance sync_combined_second_moment=True with sync_optimizer_state=False; allowed: "
                "sync_optimizer_state=True (it corrects the averaged second moment)"
            )
        _int("sync_warmup_steps", self.sync_warmup_steps, 0)
        if self.sync_warmup_steps % self.sync_every or (self.sync_warmup_steps and self.sync_every == 1):
            raise ValueError(
                f"FaultTolerance sync_warmup_steps={self.sync_warmup_steps} with sync_every={self.sync_every}; "
                "allowed: 0, or a multiple of sync_every > 1 (DiLoCo's per-step warm-up, its windows after)"
            )
        for name, top in (("outer_lr", math.inf), ("outer_momentum", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < top:
                raise ValueError(f"FaultTolerance {name}={value!r}; allowed: a number >= 0 and < {top:g}")
        if self.min_replicas > self.replicas:
            raise ValueError(
                f"FaultTolerance min_replicas={self.min_replicas} exceeds replicas={self.replicas}; allowed: 1 to {self.replicas}"
            )
        for name in ("timeout_s", "quorum_timeout_s", "max_quorum_interval_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not 0 < value <= WEEK_S
            ):
                raise ValueError(
                    f"FaultTolerance {name}={value!r}; allowed: a number of seconds > 0, at most {WEEK_S} (a week)"
                )
        host, _, port = self.bind.rpartition(":") if isinstance(self.bind, str) else ("", "", "")
        if not isinstance(self.bind, str) or not self.bind.strip() or (port.isdigit() and ":" not in host):
            raise ValueError(
                f"FaultTolerance bind={self.bind!r}; allowed: a host name or IP address (no port)"
            )

    @classmethod
    def from_env(cls, **fields: Any) -> FaultTolerance:
        """This group's settings from the environment a launcher gives it: TORCHFT_LIGHTHOUSE,
        REPLICA_GROUP_ID, NUM_REPLICA_GROUPS (required), TRAINER_FT_MIN_REPLICAS and TRAINER_FT_BIND
        (optional); `fields` (timeout_s, ...) are set as given and win over the environment."""
        for name, var in ENV.items():
            if name in fields or var not in os.environ:
                continue
            value = os.environ[var]
            if name in ("replica_id", "replicas", "min_replicas"):
                if not value.strip().isdigit():
                    raise ValueError(f"FaultTolerance.from_env: {var}={value!r}; allowed: an int >= 0")
                fields[name] = int(value)
            else:
                fields[name] = value
        missing = [ENV[name] for name in ("lighthouse", "replica_id", "replicas") if name not in fields]
        if missing:
            raise ValueError(
                f"FaultTolerance.from_env: {', '.join(missing)} not set; allowed: run under `trainer replicas` "
                "or set them (the lighthouse's host:port, this group's index, the number of groups)"
            )
        return cls(**fields)

    @property
    def lighthouse_url(self) -> str:
        """The lighthouse as torchft's clients address it."""
        return self.lighthouse if self.lighthouse.startswith("http://") else f"http://{self.lighthouse}"

    @property
    def replica_name(self) -> str:
        """This group's name at the lighthouse; torchft reads the trailing digits as the group's index."""
        return f"replica_{self.replica_id}"


class NoQuorumError(RuntimeError):
    """Fewer than `min_replicas` replica groups were alive for longer than `quorum_timeout_s`: the fit ends
    with this one line (the CLI prints it without a traceback)."""


def _host_port(name: str, value: object) -> None:
    text = value.removeprefix("http://") if isinstance(value, str) else ""
    host, sep, port = text.rpartition(":")
    if not (host and sep and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"FaultTolerance {name}={value!r}; allowed: 'host:port' (port 1-65535)")


def _int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"FaultTolerance {name}={value!r}; allowed: an int >= {minimum}")


@contextlib.contextmanager
def tokio_workers() -> Iterator[None]:
    """torchft's Rust servers and clients built inside run TOKIO_WORKERS worker threads (tokio reads
    TOKIO_WORKER_THREADS as each is built), unless the environment sets that variable already."""
    if "TOKIO_WORKER_THREADS" in os.environ:
        yield
        return
    os.environ["TOKIO_WORKER_THREADS"] = str(TOKIO_WORKERS)
    try:
        yield
    finally:
        del os.environ["TOKIO_WORKER_THREADS"]
