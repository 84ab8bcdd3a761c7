"""Bus bandwidth as nccl-tests defines it (its doc/PERFORMANCE.md): algbw = S / t, with S the size of the
message (the whole buffer a rank holds: the output of all-gather, the input of reduce-scatter), and busbw =
algbw x the op's bus factor, the fraction of S each rank must move over its slowest link in the optimal
algorithm. busbw is what compares with the link's rate, whatever the number of ranks."""

from __future__ import annotations

import re

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
GB = 1e9  # bandwidth in GB/s of 1e9 bytes, as nccl-tests prints it
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw of `op` over `n` ranks: 2(n-1)/n for all-reduce (a reduce-scatter then an all-gather),
    (n-1)/n for all-gather, reduce-scatter and all-to-all."""
    if op not in OPS:
        raise ValueError(f"collective {op!r} is unknown; allowed: {', '.join(OPS)}")
    if n < 1:
        raise ValueError(f"n={n!r} ranks is invalid; allowed: an int >= 1")
    return (2 if op == "all_reduce" else 1) * (n - 1) / n


def bandwidths(op: str, nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of one `op` of `nbytes` over `n` ranks that took `seconds`."""
    if seconds <= 0:
        raise ValueError(f"seconds={seconds!r} is invalid; allowed: a time > 0")
    algbw = nbytes / seconds / GB
    return algbw, algbw * bus_factor(op, n)


def parse_size(text: str) -> int:
    """Bytes of a size written as nccl-tests takes it: 1048576, 64K, 1M, 1G (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None or int(match.group(1)) == 0:
        raise ValueError(
            f"message size {text!r} is invalid; allowed: a positive byte count like 65536, 64K, 1M, 1G"
        )
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def check_sizes(sizes: list[int], memory: int) -> None:
    """A one-line ValueError unless a rank's buffers for the largest message (the message, its output and a
    rank's part: under 3x its size) fit in half of `memory`, the bytes one rank may use."""
    largest = max(sizes, default=0)
    if 3 * largest > memory // 2:
        raise ValueError(
            f"message size {size_text(largest)} needs {3 * largest / GB:,.1f} GB of buffers per process; "
            f"allowed: up to {memory // 6 // _UNITS['M']}M here (half of {memory / GB:.3g} GB per process)"
        )


def size_text(nbytes: int) -> str:
    """1048576 -> '1M': the largest unit that divides the size."""
    for unit in ("G", "M", "K"):
        if nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)
