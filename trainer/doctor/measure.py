"""Timing collectives and a matmul inside a running process group, the way nccl-tests does: a few warm-up
iterations, a barrier, `iters` timed back-to-back iterations (the device synchronised at both ends), and the
slowest rank's time taken (a collective is done when its last rank is)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainer.doctor.busbw import OPS, bandwidths
from trainer.doctor.groups import GroupLayout

DTYPE = torch.float32  # as nccl-tests' default; the bandwidth does not depend on it
# torch 2.13 renamed the tensor forms (the old names warn); a torch before the rename has only the old ones
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One collective over one layout's groups at one size: the slowest rank's time per iteration."""

    op: str
    group: str
    ranks: int  # in each group
    nbytes: int
    seconds: float

    @property
    def algbw(self) -> float:
        return bandwidths(self.op, self.nbytes, self.seconds, self.ranks)[0]

    @property
    def busbw(self) -> float:
        return bandwidths(self.op, self.nbytes, self.seconds, self.ranks)[1]


def make_groups(layouts: list[GroupLayout]) -> dict[str, dist.ProcessGroup]:
    """This rank's process group of each layout; every rank takes part in making every group."""
    mine = {}
    rank = dist.get_rank()
    for layout in layouts:
        for ranks in layout.groups:
            group = dist.new_group(list(ranks), group_desc=f"doctor_{layout.name}")
            if rank in ranks:
                mine[layout.name] = group
    return mine


def collective(
    op: str, nbytes: int, n: int, group: dist.ProcessGroup, device: torch.device
) -> Callable[[], None]:
    """One call of `op` on a message of `nbytes` (rounded down to whole elements per rank) over `group`."""
    count = message_elements(nbytes, n)
    full = torch.ones(count, dtype=DTYPE, device=device)
    part = torch.ones(count // n, dtype=DTYPE, device=device)
    out = torch.empty_like(full)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":  # the message is the gathered buffer
        return lambda: ALL_GATHER(out, part, group=group)
    if op == "reduce_scatter":  # the message is the buffer reduced
        return lambda: REDUCE_SCATTER(part, full, group=group)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(out, full, group=group)
    raise ValueError(f"collective {op!r} is unknown; allowed: {', '.join(OPS)}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(call: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Seconds per call, on this rank, between barriers."""
    for _ in range(warmup):
        call()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    seconds = (time.perf_counter() - start) / iters
    dist.barrier()
    return seconds


def measure_collectives(
    layouts: list[GroupLayout],
    groups: dict[str, dist.ProcessGroup],
    sizes: list[int],
    device: torch.device,
    warmup: int,
    iters: int,
) -> list[Measurement]:
    """Every op over every layout at every size; the same list on every rank."""
    plan = [(op, layout, nbytes) for op in OPS for layout in layouts for nbytes in sizes]
    local = []
    for op, layout, nbytes in plan:
        call = collective(op, nbytes, layout.size, groups[layout.name], device)
        local.append(time_call(call, device, warmup, iters))
    slowest = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [
        Measurement(
            op, layout.name, layout.size, message_elements(nbytes, layout.size) * DTYPE.itemsize, seconds
        )
        for (op, layout, nbytes), seconds in zip(plan, slowest.tolist(), strict=True)
    ]


def message_elements(nbytes: int, n: int) -> int:
    """Elements of a message of about `nbytes`: a whole number per rank (reduce-scatter and all-to-all
    split it in n), at least one each."""
    return max(nbytes // DTYPE.itemsize // n, 1) * n


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype, iters: int, repeats: int = 3) -> float:
    """Achieved dense matmul rate of this rank, in TFLOP/s (2n^3 FLOPs per n x n product): the best of
    `repeats` timings of `iters` calls (what the device gives when nothing else on the host interferes)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: kernel selection, first-touch of the memory
    best = 0.0
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b)
        _sync(device)
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start) / 1e12)
    return best


def matmul_by_size(
    device: torch.device, sizes: tuple[int, ...], dtype: torch.dtype, iters: int, repeats: int = 3
) -> dict[int, float]:
    """This rank's matmul rate (TFLOP/s) at each n x n size: small products run below a large one's rate
    (less arithmetic per byte moved, fixed per-call costs). `iters` calls at the largest size, as many more
    at the smaller ones as keep the FLOPs about equal (at most 64x), so each is timed over a similar span."""
    largest = max(sizes)
    return {
        n: matmul_tflops(device, n, dtype, min(iters * (largest // n) ** 3, iters * 64), repeats)
        for n in sorted(sizes)
    }


def matmul_together(
    device: torch.device, n: int, dtype: torch.dtype, iters: int, repeats: int = 3
) -> list[float]:
    """Every rank's matmul rate (TFLOP/s) with all ranks multiplying at once, after one barrier: ranks that
    share a host's cores, caches and memory bandwidth each get less than one rank alone."""
    dist.barrier()
    mine = matmul_tflops(device, n, dtype, iters, repeats)
    rates = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(rates, torch.tensor([mine], dtype=torch.float64, device=device))
    return [float(r.item()) for r in rates]


def matmul_alone_and_together(
    device: torch.device, sizes: tuple[int, ...], dtype: torch.dtype, iters: int, repeats: int = 3
) -> tuple[dict[int, float], list[float]]:
    """Rank zero's rate at each size alone (the other ranks wait) and every rank's at the largest size with
    all at once, alternated `repeats` times and the best of each kept: on a host other jobs load, the two
    are then measured under the same load and their ratio is the ranks' own effect on each other."""
    alone: dict[int, float] = {}
    together: list[float] = []
    for _ in range(repeats):
        if dist.get_rank() == 0:
            for n, rate in matmul_by_size(device, sizes, dtype, iters, repeats=1).items():
                alone[n] = max(alone.get(n, 0.0), rate)
        rates = matmul_together(device, max(sizes), dtype, iters, repeats=1)
        together = [max(a, b) for a, b in zip(together, rates, strict=True)] if together else rates
    return alone, together
