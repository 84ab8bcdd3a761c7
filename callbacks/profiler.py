"""Profiler: torch.profiler windows over optimizer steps, a trace per rank and a per-step breakdown.

One profiler step is one optimizer step (all its micro-batches, the data fetch before them and the
batch-end callbacks after). At the end of each active window every rank writes its Chrome/TensorBoard
trace and reads from the window's events where a step's time went: the loop's `trainer.*` spans (see
trainer.core.timing) and the collectives in flight. The trace handler talks to no other rank (each measures
its own window; the logged numbers are rank zero's); the ranks meet once after it, at the step that ends
the window, so that the slowest rank's trace writing is not charged to the next step.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerAction, ProfilerActivity

from callbacks.base import Callback
from callbacks.mfu import peak_flops
from callbacks.throughput import flops_per_token_of, no_peak_reason, ranks_per_replica
from trainer import flags
from trainer.core.logging import log, rank_zero_info

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer

PHASE_LABELS = {phase: f"trainer.{phase}" for phase in ("forward", "backward", "optimizer", "data")}
# Collectives as the trace names them: c10d ops ("c10d::allreduce_"), the backend's work ("gloo:all_reduce",
# "nccl:all_reduce", on the backend's own threads), NCCL kernels ("ncclDevKernel_AllReduce_..."), functional
# collectives ("_c10d_functional::all_gather_into_tensor"). "aten::" is left out: aten::broadcast_tensors
# and friends are shape ops, not communication.
COMM_PATTERN = re.compile(
    r"all_?reduce|all_?gather|reduce_scatter|broadcast|all_?to_?all|nccl|gloo|c10d|record_param_comms",
    re.IGNORECASE,
)
# which collective an event is, first match wins (NCCL kernels: ncclDevKernel_AllReduce_..., all-to-all runs as
# SendRecv kernels); the names the verdict gives them
COLLECTIVE_KINDS = (
    ("reduce-scatter", re.compile(r"reduce_?scatter", re.IGNORECASE)),
    ("all-to-all", re.compile(r"all_?to_?all", re.IGNORECASE)),
    ("all-gather", re.compile(r"all_?gather", re.IGNORECASE)),
    ("all-reduce", re.compile(r"all_?reduce", re.IGNORECASE)),
    ("broadcast", re.compile(r"broadcast", re.IGNORECASE)),
    ("send/recv", re.compile(r"send|recv", re.IGNORECASE)),
)
COMPUTE_PHASES = ("forward", "backward", "optimizer")
RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
MEMORY_HISTORY_ENTRIES = 100_000


def is_communication(name: str) -> bool:
    """Whether a profiler event of this name is a collective (or point-to-point) communication."""
    return not name.startswith("aten::") and COMM_PATTERN.search(name) is not None


def step_breakdown(events: Iterable[Any], steps: int) -> dict[str, float]:
    """Milliseconds per step of forward, backward, optimizer, data wait and communication in a window of
    `steps` steps, from its profiler events (FunctionEvent-like: name, time_range, device_type).

    Each is the length of the union of its spans, so nested or repeated spans (micro-batches, c10d ops
    around their backend's work) count once. Communication is in flight time, which overlaps compute
    (DDP all-reduces during backward); on a GPU it is the time of the communication kernels.
    """
    spans: dict[str, list[tuple[float, float]]] = {phase: [] for phase in PHASE_LABELS}
    label_to_phase = {label: phase for phase, label in PHASE_LABELS.items()}
    host_comm: list[tuple[float, float]] = []
    device_comm: list[tuple[float, float]] = []
    for event in events:
        interval = (event.time_range.start, event.time_range.end)
        on_host = event.device_type == DeviceType.CPU
        phase = label_to_phase.get(event.name)
        if phase is not None and on_host:
            spans[phase].append(interval)
        elif is_communication(event.name):
            (host_comm if on_host else device_comm).append(interval)
    per_step = 1e-3 / max(steps, 1)  # microseconds in the window -> milliseconds per step
    breakdown = {phase: _union_length(intervals) * per_step for phase, intervals in spans.items()}
    breakdown["comm"] = _union_length(device_comm or host_comm) * per_step
    return breakdown


def collective_kind(name: str) -> str:
    """'all-reduce', 'all-gather', ... for a communication event's name; 'other' (a barrier, a profiler
    marker) when it names none."""
    return next((kind for kind, pattern in COLLECTIVE_KINDS if pattern.search(name)), "other")


def collectives_breakdown(events: Iterable[Any], steps: int) -> dict[str, float]:
    """Milliseconds per step in flight of each kind of collective (`collective_kind`), the union of its
    spans: device kernels where there are any (a GPU), else the host's c10d ops and backend work."""
    host: dict[str, list[tuple[float, float]]] = {}
    device: dict[str, list[tuple[float, float]]] = {}
    for event in events:
        if is_communication(event.name):
            spans = host if event.device_type == DeviceType.CPU else device
            spans.setdefault(collective_kind(event.name), []).append(
                (event.time_range.start, event.time_range.end)
            )
    per_step = 1e-3 / max(steps, 1)
    return {kind: _union_length(intervals) * per_step for kind, intervals in (device or host).items()}


def verdict(breakdown: dict[str, float], by_kind: dict[str, float], step_ms: float, group: str | None) -> str:
    """Whether the step is bound by computation or communication, in words, with the measured ratio.

    The ratio is communication in flight (`comm`) over computation (forward + backward + optimizer). Where
    it is 1 or more, no overlap can hide the communication: the step is communication-bound, and the
    verdict names the collective that is in flight longest and its share of the step."""
    compute = sum(breakdown[phase] for phase in COMPUTE_PHASES)
    comm = breakdown["comm"]
    ratio = comm / compute if compute > 0 else math.inf
    if ratio < 1 or not by_kind:
        return f"comm/compute {ratio:.2f}: compute-bound"
    kind = max(by_kind, key=by_kind.get)
    share = 100 * by_kind[kind] / step_ms if step_ms > 0 else math.inf
    return f"comm/compute {ratio:.2f}: communication-bound: the {f'{group} ' if group else ''}{kind} takes {share:.0f}% of the step"


def data_parallel_group(strategy: Any) -> str | None:
    """The name of the one group a run's collectives can be over, when its mesh has one (DDP: "batch"):
    the trace does not say which group a gloo collective ran on. None when there are several, or none."""
    dims = getattr(getattr(strategy, "mesh", None), "dims", None)
    if dims is None:
        return None
    views = [name for name in ("batch", "dense", "tp", "cp", "pp", "ep", "expert") if dims.size(name) > 1]
    partitions = {tuple(map(tuple, dims.groups(name))) for name in views}
    return views[0] if len(partitions) == 1 else None


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


class Profiler(Callback):
    """Profiles optimizer steps with `torch.profiler`: `wait` steps idle, `warmup` steps traced and thrown
    away, `active` steps recorded; `repeat` such cycles (0: until the run ends). For each window every rank
    writes `<dirpath>/rank-<r>/step-<N>.pt.trace.json` (default dirpath `<default_root_dir>/profiler`; N is
    the window's last step) for chrome://tracing, Perfetto or TensorBoard, and rank zero logs `profiler/*`:
    forward, backward, optimizer, data and comm milliseconds per step, step time, tokens/s per device and
    MFU (GPU in the peak table) or achieved model FLOP/s, and `profiler/comm_compute_ratio`; its console
    line ends with the verdict, "compute-bound" or "communication-bound: the <group> all-reduce takes X% of
    the step" (see `verdict`). `memory_snapshot` (CUDA) records allocator
    history from setup and dumps it (for pytorch.org/memory_viz) after the first window and on OOM.
    """

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        dirpath: str | Path | None = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        memory_snapshot: bool = False,
        flops_per_token: float | None = None,
    ) -> None:
        for name, value, low in (
            ("wait", wait, 0),
            ("warmup", warmup, 0),
            ("active", active, 1),
            ("repeat", repeat, 0),
        ):
            flags.check_int(name, value, low)
        switches = {
            "record_shapes": record_shapes,
            "profile_memory": profile_memory,
            "with_stack": with_stack,
            "memory_snapshot": memory_snapshot,
        }
        for name, value in switches.items():
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is invalid; allowed: True or False")
        if dirpath is not None and not isinstance(dirpath, (str, Path)):
            raise ValueError(f"dirpath={dirpath!r} is invalid; allowed: a path or None")
        flags.check_number("flops_per_token", flops_per_token, 0, strict=True, allow_none=True)
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.memory_snapshot = memory_snapshot
        self.flops_per_token = float(flops_per_token) if flops_per_token is not None else None
        self.trace_paths: list[Path] = []  # this rank's traces, in the order written
        # seconds the loop stood still for the profiler (collecting and writing traces); throughput
        # watchers leave them out (see ThroughputMonitor)
        self.stall_s = 0.0
        self._reset()

    def _reset(self) -> None:
        self._prof: torch.profiler.profile | None = None
        self._trainer: Trainer | None = None
        self._module: Any = None
        self._rank_dir: Path | None = None
        self._recording_memory = False
        self._snapshot_taken = False
        self._can_log = True
        self._windows = 0
        self._window_steps = 0
        self._start: tuple[float, int] | None = None  # (perf_counter, tokens_seen) when the window began
        self._end: tuple[float, int] | None = None  # the same after its last step
        self._flops: float | None = None
        self._flops_resolved = False
        self._peak: float | None = None

    # ---- hooks -----------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if stage != "fit":
            return
        root = self.dirpath if self.dirpath is not None else Path(trainer.default_root_dir) / "profiler"
        self._rank_dir = root / f"rank-{trainer.strategy.global_rank}"
        if not self.memory_snapshot:
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._recording_memory = True
        else:
            rank_zero_info(
                "Profiler: memory_snapshot is CUDA-only and this run is on "
                f"{trainer.strategy.root_device.type}; no snapshot is recorded"
            )

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._trainer, self._module = trainer, module
        device = trainer.strategy.root_device
        self._peak = peak_flops(device)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat
            ),
            on_trace_ready=self._on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        first = trainer.global_step + self.wait + self.warmup + 1
        rank_zero_info(
            f"Profiler: recording steps {first}-{first + self.active - 1}"
            + (f" (then every {self.wait + self.warmup + self.active} steps)" if self.repeat != 1 else "")
            + f"; traces to {self._rank_dir.parent}"
            + (
                ""
                if self._peak is not None
                else f"; no MFU, {no_peak_reason(device)}: achieved FLOP/s instead"
            )
        )
        self._prof.start()
        self._after_step(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        prof = self._prof
        if prof is None:
            return
        if prof.current_action in RECORDING:
            self._window_steps += 1
            self._end = (time.perf_counter(), trainer.state.tokens_seen)
        began, windows = time.perf_counter(), self._windows
        with warnings.catch_warnings():  # that each cycle starts afresh is what a per-window breakdown wants
            warnings.filterwarnings(
                "ignore", message="Warning: Profiler clears events at the end of each cycle"
            )
            prof.step()  # ends a window with _on_trace_ready
        if self._windows != windows:
            # every rank ends the window at this step; wait for the slowest writer here, so that the next
            # step's collectives don't charge the trace writing to training time
            trainer.strategy.barrier(group="world")
        if self.repeat and self._windows >= self.repeat:
            self._stop(trainer)  # the schedule is done: stop stepping a profiler that records nothing
        else:
            self._after_step(trainer)
        self.stall_s += time.perf_counter() - began

    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._stop(trainer)  # here, not in teardown: loggers are still open, so a partial window is logged
        if self._windows == 0:
            rank_zero_info(
                "Profiler: the run ended before a window was recorded "
                f"(it needs {self.wait + self.warmup + 1} steps)"
            )

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        if self._recording_memory and isinstance(exception, torch.cuda.OutOfMemoryError):
            path = self._dump_memory_snapshot()
            log.warning(f"Profiler: out of memory; allocator history written to {path}")

    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if stage != "fit":
            return
        self._can_log = False  # on_fit_end did not run (a failure): write the trace, log nothing
        try:
            self._stop(trainer)
        except Exception as err:  # teardown also runs after a failure: don't hide that one
            log.warning(f"Profiler: stopping the profiler failed: {err}")
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
        self._reset()

    # ---- windows ---------------------------------------------------------------------------------
    def _after_step(self, trainer: Trainer) -> None:
        """The profiler entered a new step: mark where a window begins; time phases on the device while
        the profiler traces (on a GPU, host spans are launch times unless the clock synchronizes)."""
        action = self._prof.current_action
        if action in RECORDING and self._start is None:
            self._start = (time.perf_counter(), trainer.state.tokens_seen)
        tracing = action in (ProfilerAction.WARMUP, *RECORDING)
        self._sync_clock(trainer, tracing and trainer.strategy.root_device.type == "cuda")

    def _stop(self, trainer: Trainer) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()  # inside a window, this hands its steps so far to _on_trace_ready
        self._sync_clock(trainer, False)

    def _sync_clock(self, trainer: Trainer, on: bool) -> None:
        if on:
            trainer.clock.request_sync(self, torch.cuda.synchronize)
        else:
            trainer.clock.release_sync(self)

    def _on_trace_ready(self, prof: torch.profiler.profile) -> None:
        """Runs on every rank at the end of a window: write the trace, measure, log. No collectives."""
        trainer, steps, start, end = self._trainer, self._window_steps, self._start, self._end
        self._window_steps, self._start, self._end = 0, None, None
        if trainer is None or steps == 0 or start is None or end is None:
            return  # a window that ended before any of its steps ran
        self._windows += 1
        self._rank_dir.mkdir(parents=True, exist_ok=True)
        path = self._rank_dir / f"step-{trainer.global_step}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.trace_paths.append(path)
        events = prof.events()
        breakdown = step_breakdown(events, steps)
        metrics = {f"profiler/{k}_ms": v for k, v in breakdown.items()}
        seconds = max(end[0] - start[0], 1e-9)
        metrics["profiler/step_ms"] = 1e3 * seconds / steps
        compute = sum(breakdown[phase] for phase in COMPUTE_PHASES)
        if compute > 0:
            metrics["profiler/comm_compute_ratio"] = breakdown["comm"] / compute
        found = verdict(
            breakdown,
            collectives_breakdown(events, steps),
            metrics["profiler/step_ms"],
            data_parallel_group(trainer.strategy),
        )
        tokens_per_s = (end[1] - start[1]) / (seconds * ranks_per_replica(trainer))
        if tokens_per_s > 0:
            metrics["profiler/tokens_per_s_per_device"] = tokens_per_s
            if not self._flops_resolved:
                self._flops = self.flops_per_token or flops_per_token_of(trainer, self._module, "Profiler")
                self._flops_resolved = True
            if self._flops is not None:
                metrics["profiler/flops_per_s_per_device"] = tokens_per_s * self._flops
                if self._peak is not None:
                    metrics["profiler/mfu"] = tokens_per_s * self._flops / self._peak
        if self._can_log:
            trainer.log_metrics(metrics)
        rank_zero_info(_summary(trainer.global_step - steps + 1, trainer.global_step, metrics, path, found))
        if self._recording_memory and not self._snapshot_taken:
            self._dump_memory_snapshot()
            self._snapshot_taken = True

    def _dump_memory_snapshot(self) -> Path:
        self._rank_dir.mkdir(parents=True, exist_ok=True)
        path = self._rank_dir / "memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return path


def _summary(first: int, last: int, m: dict[str, float], path: Path, found: str) -> str:
    """One line for rank zero's console: where the window's step time went."""
    phases = ", ".join(
        f"{k} {m[f'profiler/{k}_ms']:.1f}" for k in ("data", "forward", "backward", "optimizer", "comm")
    )
    line = f"Profiler: steps {first}-{last}, ms per step: {phases} (step {m['profiler/step_ms']:.1f})"
    if "profiler/tokens_per_s_per_device" in m:
        line += f" | {m['profiler/tokens_per_s_per_device']:,.0f} tokens/s per device"
    if "profiler/mfu" in m:
        line += f", MFU {100 * m['profiler/mfu']:.1f}%"
    elif "profiler/flops_per_s_per_device" in m:
        line += f", {m['profiler/flops_per_s_per_device'] / 1e9:.2f} GFLOP/s achieved"
    return f"{line} | {found} | trace {path}"
