"""bench/thread_cpu.py, which bench/fault_tolerance.py prints rank 0's CPU per step by: a thread's CPU time goes
to its kind (the training thread, the DDP groups' ring by its Python name, gloo's and torchft's by the names
their libraries give their threads)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from helpers import bench_module


@pytest.fixture(scope="module")
def thread_cpu():
    return bench_module("thread_cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc's per-thread schedstat is Linux's")
def test_a_busy_ring_thread_counts_as_ring_and_nothing_else_does(thread_cpu):
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:  # 50 ms of this thread's own CPU time (its clock, not the wall's)
        start = time.thread_time()
        while time.thread_time() - start < 0.05:
            pass
        spun.set()
        done.wait()

    before = thread_cpu.thread_cpu()
    ring = threading.Thread(target=spin, name=thread_cpu.RING_THREAD)
    ring.start()
    spun.wait()
    after = thread_cpu.thread_cpu()
    done.set()
    ring.join()
    assert set(after) == set(thread_cpu.KINDS)
    assert after["ring"] - before["ring"] >= 0.05, (before, after)
    assert before["main"] > 0.0
    # the spin went to no other kind (a thread gloo or torchft left here from an earlier test did little since)
    assert all(after[kind] - before[kind] < 0.05 for kind in ("gloo", "torchft")), (before, after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_machines_busy_time_counts_a_threads_spin(thread_cpu):
    busy, idle = thread_cpu.machine_cpu()
    start = time.thread_time()
    while time.thread_time() - start < 0.1:  # 100 ms of this thread's own CPU time
        pass
    busy_after, idle_after = thread_cpu.machine_cpu()
    # (/proc/stat counts in ticks of 10 ms; other processes only add busy time)
    assert busy_after - busy >= 0.07, (busy, busy_after)
    assert idle_after >= idle
