"""The lighthouse: torchft's coordinator that forms each step's quorum of replica groups (`trainer
lighthouse`). It holds no training state; when it restarts, the groups' next quorum waits for it."""

from __future__ import annotations

import signal
import threading
from typing import Any

from trainer.fault_tolerance.config import HEARTBEAT_TIMEOUT_MS, QUORUM_TICK_MS
from trainer.fault_tolerance.manager import require_torchft


def start_lighthouse(
    bind: str,
    min_replicas: int = 1,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    join_timeout_ms: int = 60000,
) -> Any:
    """A running lighthouse listening on `bind` ("host:port", port 0: one the system picks); its
    `address()` is what `FaultTolerance(lighthouse=...)` takes, `shutdown()` stops it. A group whose
    heartbeat is older than `heartbeat_timeout_ms` is dead (the survivors' stall after a crash); a quorum
    waits up to `join_timeout_ms` for groups that heartbeat but have not asked to join yet."""
    require_torchft()
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=QUORUM_TICK_MS,
    )


def serve_until_signalled(server: Any) -> None:
    """Block until SIGINT or SIGTERM, then stop `server`."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


def run_lighthouse(bind: str, min_replicas: int, heartbeat_timeout_ms: int, join_timeout_ms: int) -> int:
    """`trainer lighthouse`: start one, print the address the groups join ("lighthouse listening on
    http://host:port", the first line of stdout), serve until SIGINT/SIGTERM."""
    host, _, port = bind.rpartition(":")
    if not (host and port.isdigit() and int(port) < 65536):
        raise ValueError(f"lighthouse --bind {bind!r}; allowed: host:port (port 0: one the system picks)")
    for name, value in (("--min-replicas", min_replicas), ("--heartbeat-timeout-ms", heartbeat_timeout_ms),
                        ("--join-timeout-ms", join_timeout_ms)):  # fmt: skip
        if value < 1:
            raise ValueError(f"lighthouse {name} {value}; allowed: an int >= 1")
    server = start_lighthouse(bind, min_replicas, heartbeat_timeout_ms, join_timeout_ms)
    # torchft reports the machine's host name; the groups must dial the address it listens on
    print(f"lighthouse listening on http://{host}:{server.address().rpartition(':')[2]}", flush=True)
    serve_until_signalled(server)
    return 0
