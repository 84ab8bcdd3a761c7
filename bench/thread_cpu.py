"""A process's CPU time by kind of thread, from Linux's /proc (each thread's schedstat: nanoseconds on a CPU):
where a step's CPU goes beside the training thread (gloo's threads, the replica groups' ring, torchft's)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

KINDS = ("main", "gloo", "ring", "torchft", "other")
RING_THREAD = "trainer-group-ring"  # trainer/fault_tolerance/overlap_ddp.py's thread (a Python thread's name)


def thread_cpu() -> dict[str, float]:
    """Seconds on a CPU so far per kind of this process's live threads (empty where /proc has no tasks)."""
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    # Linux: the main thread's id is the process's; threading's is its parent's in a fork on Python 3.11
    main = os.getpid()
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return {}
    totals = dict.fromkeys(KINDS, 0.0)
    for task in tasks.iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
            comm = (task / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        tid = int(task.name)
        name = python_names.get(tid, comm)
        if tid == main:
            kind = "main"
        elif name == RING_THREAD:
            kind = "ring"
        elif comm.startswith(("gloo", "pt_gloo")):
            kind = "gloo"
        elif name.startswith("torchft"):  # its Rust runtimes' threads and its Python quorum thread
            kind = "torchft"
        else:
            kind = "other"
        totals[kind] += ns / 1e9
    return totals


def machine_cpu() -> tuple[float, float]:
    """Seconds the machine's CPUs were busy and idle so far, summed over them (/proc/stat; zeros where it has
    none): what every process together used, whether or not the bench started it."""
    try:
        ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = ticks[3] + ticks[4]  # idle, iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks[:8]) - idle) / hz, idle / hz  # user..steal (guest time is counted in user)
