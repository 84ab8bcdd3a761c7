"""How many processes a tool may start on this machine: the bound that turns a mistyped count into one line
instead of a machine thrashing under thousands of processes."""

from __future__ import annotations

import os

PROCESSES_PER_CORE = 4  # past this, gloo ranks only wait on each other for a core; each holds torch's memory


def check_local_processes(what: str, processes: int) -> None:
    """A one-line ValueError when `processes` (the count `what` asks for) exceed this machine's bound."""
    cores = len(os.sched_getaffinity(0))
    most = PROCESSES_PER_CORE * cores
    if processes > most:
        raise ValueError(
            f"{what} starts {processes} processes on this machine; allowed: up to {most} "
            f"({PROCESSES_PER_CORE} per core of its {cores})"
        )
