"""Pipeline bubble per schedule, measured with `torch.distributed.pipelining`, next to (p-1)/m.

For p = 2 and 4 pipeline ranks (real processes over gloo) and m = 2, 4, 8, 16 micro-batches, each
schedule runs a few training steps. Per rank: busy = time inside the stages' forward, backward and
weight-gradient calls (summed over the rank's stage chunks); idle = step wall time - busy, where a step
runs from a barrier before `schedule.step` to a barrier after it (the optimizer step would wait for the
whole pipeline to drain); both are medians over the measured steps. Idle therefore also holds the
point-to-point sends and receives and the schedule's own bookkeeping, which the textbook leaves out.
Bubble = idle / busy, as the mean over ranks and the worst rank, printed next to the textbook (p-1)/m
(one stage per rank, backward = 2 x forward) and their ratio. Interleaved and V schedules hold v = 2
stage chunks per rank; their own textbook bubble is (p-1)/(v m), printed beside it.

The default work is synthetic: each chunk is a chain of autograd Functions that `time.sleep`, forward
t_f, input gradient t_b and weight gradient t_w per rank and micro-batch (split over the rank's chunks),
30 ms each by default: the sends, receives and schedule bookkeeping cost ~1-3 ms per micro-batch here,
which at 10 ms of work alone lifts 1F1B's measured bubble 11-35% above (p-1)/m (at 30 ms: 4-12%).
This machine has 2 cores, so 4 processes that really computed would share them and the contention would
show up as busy time; a sleep takes its time whatever the others do. The weight gradient is its own
autograd node on the parameter's path, so the zero-bubble schedules (input gradients first, weight
gradients later) really can move it into the bubble. `--work model` runs real matmuls instead (one
thread per process): meaningful only on a machine with a free core per pipeline rank.

Run: .venv/bin/python bench/pipeline.py [--quick]     (--quick: p=2, m=4 only; --help for the rest)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
V_SHAPED = ("ZBVZeroBubble",)  # rank r holds stages r and 2p-1-r (the V), not r and r+p
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")
RANKS, MICRO_BATCHES = (2, 4), (2, 4, 8, 16)
ROWS, WIDTH = 4, 16  # one micro-batch of the sleep work: its size does not matter, only the sleeps do
MODEL_ROWS, MODEL_WIDTH, MODEL_LAYERS = 256, 512, 4  # --work model: layers per rank, split over chunks


@dataclass(frozen=True)
class Work:
    """What a rank does per micro-batch: sleeps of f/b/w seconds, or MODEL_LAYERS real layers."""

    kind: str  # "sleep" or "model"
    f: float
    b: float
    w: float


class _Sleep(torch.autograd.Function):
    """Identity that sleeps `fwd_s` in forward and `bwd_s` in backward: work of a set length."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.bwd_s)
        return grad, None, None


class SleepChunk(torch.nn.Module):
    """y = Sleep_fb(x * Sleep_w(weight)). The product is where the parameter's path joins the input's,
    so the input gradient runs Sleep_fb's backward (t_b) and the weight gradient runs Sleep_w's (t_w).
    (torch runs the first stage's whole backward in its weight-gradient slot: its input needs no grad.)"""

    def __init__(self, f: float, b: float, w: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(WIDTH))
        self.f, self.b, self.w = f, b, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * _Sleep.apply(self.weight, 0.0, self.w), self.f, self.b)


def make_chunk(work: Work, v: int) -> torch.nn.Module:
    """One of a rank's v stage chunks, carrying 1/v of the rank's work."""
    if work.kind == "sleep":
        return SleepChunk(work.f / v, work.b / v, work.w / v)
    layers = []
    for _ in range(MODEL_LAYERS // v):
        layers += [torch.nn.Linear(MODEL_WIDTH, MODEL_WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


class TimedStage(PipelineStage):
    """A PipelineStage that adds the time of its compute calls to `busy`. The schedule waits for the
    received activations and gradients before it makes these calls, so communication is not in them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.busy = 0.0

    def _timed(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.busy += time.perf_counter() - start

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def measure(name: str, p: int, m: int, rank: int, work: Work, steps: int, warmup: int) -> dict[str, Any]:
    """This rank's busy and idle seconds per step for one schedule: medians over the measured steps, as
    common.seconds_per_step takes, so one step disturbed by the rest of the machine does not move them."""
    cls = get_schedule_class(name)
    v = 1 if issubclass(cls, PipelineScheduleSingle) else 2
    ids = [rank] if v == 1 else [rank, 2 * p - 1 - rank] if name in V_SHAPED else [rank, rank + p]
    torch.manual_seed(0)  # the same inputs and weights in every run (the sleeps do not depend on them)
    stages = [TimedStage(make_chunk(work, v), i, p * v, torch.device("cpu")) for i in ids]
    try:
        schedule = cls(stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=_loss)
    except (ValueError, AssertionError) as e:  # raised alike on every rank: no collective is left waiting
        return {"v": v, "error": str(e).splitlines()[0]}
    rows, width = (ROWS, WIDTH) if work.kind == "sleep" else (MODEL_ROWS, MODEL_WIDTH)
    x, target = torch.randn(m * rows, width), torch.zeros(m * rows, width)
    args = (x,) if 0 in ids else ()
    kwargs = {"target": target} if p * v - 1 in ids else {}
    busy, idle = [], []
    for step in range(warmup + steps):
        for stage in stages:
            stage.busy = 0.0
        dist.barrier()
        start = time.perf_counter()
        schedule.step(*args, **kwargs)
        dist.barrier()
        wall = time.perf_counter() - start
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
        if step >= warmup:
            busy.append(sum(stage.busy for stage in stages))
            idle.append(wall - busy[-1])
    return {"v": v, "busy": statistics.median(busy), "idle": statistics.median(idle)}


def _rank_main(
    rank: int, p: int, port: int, runs: list[tuple[str, int]], work: Work, steps: int, warmup: int
) -> None:
    """One pipeline rank: join the gloo group, measure every (schedule, m), rank 0 posts all ranks' numbers
    to the parent's store."""
    torch.set_num_threads(1)
    store = dist.PrefixStore(f"pp{p}", dist.TCPStore("127.0.0.1", port, is_master=False))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=p)
    try:
        mine = [measure(name, p, m, rank, work, steps, warmup) for name, m in runs]
        every = [None] * p
        dist.all_gather_object(every, mine)
        if rank == 0:
            store.set("results", json.dumps(every))
    finally:
        dist.destroy_process_group()


def run_ranks(p: int, runs: list[tuple[str, int]], work: Work, steps: int, warmup: int) -> list[list[dict]]:
    """Spawn p ranks once for all `runs`; returns results[rank][run]."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the OS picks the port
    mp.spawn(_rank_main, args=(p, store.port, runs, work, steps, warmup), nprocs=p)
    return json.loads(dist.PrefixStore(f"pp{p}", store).get("results"))


def _ms(values: list[float]) -> str:
    return "/".join(f"{v * 1e3:.0f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="p=2, m=4 only: a smoke run")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per schedule (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted steps first (default 1)")
    parser.add_argument(
        "--work",
        choices=("sleep", "model"),
        default="sleep",
        help="sleep: set-length synthetic work (default; valid on any number of cores). model: real "
        f"{MODEL_LAYERS} x Linear({MODEL_WIDTH}) + tanh per rank, one thread per process; only meaningful "
        "with a free core per pipeline rank",
    )
    parser.add_argument(
        "--t-f", type=float, default=30.0, help="sleep work: forward ms per rank and micro-batch (default 30)"
    )
    parser.add_argument("--t-b", type=float, default=30.0, help="sleep work: input-gradient ms (default 30)")
    parser.add_argument("--t-w", type=float, default=30.0, help="sleep work: weight-gradient ms (default 30)")
    opts = parser.parse_args()
    if opts.steps < 1 or opts.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {opts.steps} and {opts.warmup}")
    work = Work(opts.work, opts.t_f / 1e3, opts.t_b / 1e3, opts.t_w / 1e3)
    ranks, micro = ((2,), (4,)) if opts.quick else (RANKS, MICRO_BATCHES)

    began = time.perf_counter()
    what = (
        f"sleep work per rank and micro-batch: forward {opts.t_f:g} ms, input grad {opts.t_b:g} ms, "
        f"weight grad {opts.t_w:g} ms"
        if work.kind == "sleep"
        else f"model work: {MODEL_LAYERS} x Linear({MODEL_WIDTH}) + tanh per rank, {MODEL_ROWS} rows per micro-batch"
    )
    print(f"{what}; {opts.steps} measured steps after {opts.warmup} warm-up; {os.cpu_count()} cores, gloo")
    print(
        "busy, idle: ms per step for each rank; bubble = idle / busy (mean over ranks, worst rank); "
        "ratio = bubble / ((p-1)/m)"
    )
    header = (
        f"{'schedule':<22}{'p':>2}{'m':>4}{'v':>2}  {'busy ms':<20}{'idle ms':<16}"
        f"{'bubble':>7}{'max':>7}{'(p-1)/m':>9}{'ratio':>7}{'(p-1)/vm':>9}"
    )
    ratios_1f1b, zero_bubble = [], []
    for p in ranks:
        runs = [(name, m) for name in SCHEDULES for m in micro]
        results = run_ranks(p, runs, work, opts.steps, opts.warmup)
        print()
        print(header)
        for i, (name, m) in enumerate(runs):
            row = [results[r][i] for r in range(p)]
            v, theory = row[0]["v"], (p - 1) / m
            if "error" in row[0]:
                print(f"{name:<22}{p:>2}{m:>4}{v:>2}  not run: {row[0]['error']}")
                continue
            busy, idle = [r["busy"] for r in row], [r["idle"] for r in row]
            bubbles = [i / b for i, b in zip(idle, busy, strict=True)]
            mean = statistics.mean(bubbles)
            print(
                f"{name:<22}{p:>2}{m:>4}{v:>2}  {_ms(busy):<20}{_ms(idle):<16}"
                f"{mean:7.3f}{max(bubbles):7.3f}{theory:9.3f}{mean / theory:7.2f}{theory / v:9.3f}"
            )
            if name == "1F1B" and m >= 4:
                ratios_1f1b.append(mean / theory)
            if name in ZERO_BUBBLE:
                zero_bubble.append((mean < theory, f"{name} p={p} m={m}"))
    print()
    if ratios_1f1b:
        print(
            f"1F1B, m >= 4: measured / (p-1)/m from {min(ratios_1f1b):.2f} to {max(ratios_1f1b):.2f} "
            f"(issue: within 20%, i.e. 0.80 to 1.20)"
        )
    if zero_bubble:
        above = [label for below, label in zero_bubble if not below]
        print(
            f"zero-bubble schedules below (p-1)/m: {len(zero_bubble) - len(above)} of {len(zero_bubble)} rows"
            + (f"; not below: {', '.join(above)}" if above else "")
        )
    print(f"total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
