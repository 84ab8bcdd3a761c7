"""Host memory kept for reuse between steps (glibc's malloc, on Linux).

A training step frees most of what it allocated (activations, gradients, temporaries) and allocates the
same again in the next step. glibc's defaults hand large freed blocks back to the kernel: blocks above a
threshold that only rises to the largest one freed so far are unmapped, and the heap's top is trimmed as
soon as more than twice that is free. Every step then faults its memory in again, page by page, zeroed by
the kernel: on a CPU run that was 10-70 ms of system time per step (DP-SGD's text classifier of
bench/dpsgd.py at batch 64 and 256: some 7,000 and 30,000 page faults per step). With blocks up to
glibc's largest threshold served from the heap and freed memory kept at its top, a step reuses the pages
of the one before: the process holds its peak between steps, which the next step needs anyway. The cost:
blocks in the heap fragment it more than unmapped ones, so the peak can be higher (in bench/dpsgd.py's
ghost arm at batch 256, about 200 -> 235 MiB of peak RSS over the start). Set for CPU runs only (a GPU
run's large tensors live in the CUDA caching allocator).
"""

from __future__ import annotations

import ctypes
import os
import platform

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h> parameter numbers
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit: bigger blocks are still unmapped when freed
TRIM_THRESHOLD = 1 << 30  # freed memory at the heap's top kept up to this much (at most the step's peak)
# a user's own malloc tuning (environment variables glibc reads at start-up) wins over ours
_USER_TUNING = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_applied: bool | None = None  # once per process: True if set here, False if not applicable


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed memory for the next step instead of returning it to the kernel (see
    the module docstring); once per process. False where it does not apply: another OS or C library, or
    malloc tuning already set in the environment. (Under a preloaded jemalloc or tcmalloc it is harmless:
    glibc's malloc, tuned here, then serves nothing.)"""
    global _applied
    if _applied is None:
        _applied = _set_thresholds()
    return _applied


def _set_thresholds() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in _USER_TUNING):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # both set: setting either also stops glibc's own raising of the thresholds
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
