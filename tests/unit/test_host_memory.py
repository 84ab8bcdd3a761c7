"""trainer/host_memory.py: after `keep_freed_memory`, a step-like round of allocations reuses the pages the
previous round freed instead of faulting them in again (glibc's defaults trim them away)."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from trainer import host_memory
from trainer.host_memory import keep_freed_memory


def _round_faults() -> int:
    """Minor page faults of one round: three 16 MiB tensors written, then all freed (48 MiB at the
    heap's top, more than glibc's default trim threshold lets it keep)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(4 << 20) for _ in range(3)]
    del tensors
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_second_round_of_allocations_reuses_the_freed_pages(monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(host_memory, "_applied", None)  # decided afresh, without the variables
    assert keep_freed_memory()
    _round_faults()  # the heap grows to the round's size once
    pages = 3 * (16 << 20) // resource.getpagesize()
    assert _round_faults() < pages // 20  # without it: every page again (about `pages` faults)
