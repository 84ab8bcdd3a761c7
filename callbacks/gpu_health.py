"""GPUHealthMonitor: NVML health checks of every rank's GPU, polled off the training thread.

A daemon thread reads this rank's GPU every `interval_s` and judges the reading; the training thread
only picks up the latest verdict. Every `check_every_n_steps` steps the ranks agree (all-reduce max) on
the worst level, so all of them warn, or save a checkpoint and stop, at the same step. Without an
NVIDIA GPU (or without nvidia-ml-py) the monitor says so in one line and does nothing else.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.imports import RequirementCache

from callbacks.base import Callback
from trainer import flags
from trainer.core.logging import log, rank_zero_info

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer

LEVELS = ("ok", "warn", "stop")
_NVML_AVAILABLE = RequirementCache("nvidia-ml-py", "pynvml")  # imports pynvml only when first asked
FATAL_CHECKS = frozenset({"gpu_lost", "ecc", "remapped_rows", "xid"})
# XIDs an application causes (a faulting kernel, a killed process), not a failing GPU (as DCGM sees them)
APPLICATION_XIDS = (13, 31, 43, 45)
METRICS = ("gpu/temperature_c", "gpu/power_w", "gpu/memory_used_gb")


@dataclass(frozen=True)
class GPUReading:
    """One poll of a GPU; None where the GPU does not expose a reading. Error counters count since the
    driver loaded; `xids` are the critical XID errors seen since monitoring started."""

    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    memory_used_gb: float | None = None
    clock_event_reasons: int | None = None
    ecc_uncorrected: int | None = None
    rows_pending: bool = False
    rows_failed: bool = False
    pcie_replays: int | None = None
    nvlink_errors: dict[int, int] = field(default_factory=dict)  # link -> sum of its error counters
    xids: tuple[int, ...] = ()
    error: str | None = None  # the poll failed
    gpu_lost: bool = False


def slowdown_reasons(nvml: Any) -> dict[int, str]:
    """Clock-event bits that mean the GPU slows itself down (SW power cap and idle are normal)."""
    return {
        nvml.nvmlClocksEventReasonHwSlowdown: "HW slowdown",
        nvml.nvmlClocksEventReasonHwThermalSlowdown: "HW thermal slowdown",
        nvml.nvmlClocksEventReasonSwThermalSlowdown: "SW thermal slowdown",
        nvml.nvmlClocksEventReasonHwPowerBrakeSlowdown: "HW power brake",
    }


@dataclass(frozen=True)
class HealthPolicy:
    """Judges a reading against the one taken when monitoring started."""

    slowdown_bits: dict[int, str]
    max_temperature_c: float = 85.0
    max_power_fraction: float = 1.0
    ignored_xids: frozenset[int] = frozenset(APPLICATION_XIDS)

    def assess(self, now: GPUReading, start: GPUReading) -> tuple[str, dict[str, str]]:
        """The level ("ok", "warn", "stop") and the reasons for it, keyed by the check that found them."""
        reasons: dict[str, str] = {}
        if now.gpu_lost:
            reasons["gpu_lost"] = f"the GPU is lost (fell off the bus or the driver gave it up): {now.error}"
        elif now.error:
            reasons["nvml_error"] = f"reading the GPU through NVML failed: {now.error}"
        if now.temperature_c is not None and now.temperature_c > self.max_temperature_c:
            reasons["temperature"] = (
                f"temperature {now.temperature_c:.0f} C is above max_temperature_c={self.max_temperature_c:g}"
            )
        if (
            now.power_w is not None
            and now.power_limit_w
            and now.power_w > self.max_power_fraction * now.power_limit_w
        ):
            reasons["power"] = (
                f"power {now.power_w:.0f} W is above max_power_fraction={self.max_power_fraction:g} of the "
                f"enforced limit {now.power_limit_w:.0f} W"
            )
        slowed = [name for bit, name in self.slowdown_bits.items() if (now.clock_event_reasons or 0) & bit]
        if slowed:
            reasons["clocks"] = (
                f"clocks slowed by {', '.join(slowed)} (event reasons {now.clock_event_reasons:#x})"
            )
        if _grew(now.ecc_uncorrected, start.ecc_uncorrected):
            reasons["ecc"] = (
                f"{now.ecc_uncorrected - start.ecc_uncorrected} uncorrected ECC error(s) in GPU memory since "
                "monitoring started"
            )
        if now.rows_failed:
            reasons["remapped_rows"] = "memory row remapping failed: replace this GPU"
        elif now.rows_pending:
            reasons["remapped_rows"] = "memory rows are pending remapping: this GPU needs a reset"
        xids = [xid for xid in now.xids if xid not in self.ignored_xids]
        if xids:
            reasons["xid"] = f"critical XID error(s) {', '.join(map(str, xids))}"
        if _grew(now.pcie_replays, start.pcie_replays):
            reasons["pcie"] = f"PCIe replay counter +{now.pcie_replays - start.pcie_replays} (link errors)"
        links = [link for link, n in now.nvlink_errors.items() if _grew(n, start.nvlink_errors.get(link))]
        if links:
            reasons["nvlink"] = f"NVLink error counters grew on link(s) {', '.join(map(str, links))}"
        level = "stop" if FATAL_CHECKS & reasons.keys() else "warn" if reasons else "ok"
        return level, reasons


def _grew(now: int | None, start: int | None) -> bool:
    return now is not None and start is not None and now > start


class NvmlReader:
    """Reads one GPU through NVML (`nvml`: the pynvml module or a stand-in with its names). Readings
    the GPU does not expose are left None; any other failure becomes the reading's `error`."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle
        # what a GPU or driver answers for a reading it does not have: that reading is skipped
        self.unexposed = (
            nvml.NVML_ERROR_NOT_SUPPORTED,
            nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
            nvml.NVML_ERROR_NO_PERMISSION,
        )
        self.xids: list[int] = []
        self.links = [link for link in range(nvml.NVML_NVLINK_MAX_LINKS) if self._link_active(link)]
        self.events = self._optional(self._watch_xids)

    def read(self) -> GPUReading:
        """Poll every reading once."""
        nvml, h, get = self.nvml, self.handle, self._optional
        try:
            power, limit = get(nvml.nvmlDeviceGetPowerUsage, h), get(nvml.nvmlDeviceGetEnforcedPowerLimit, h)
            memory = get(nvml.nvmlDeviceGetMemoryInfo, h)
            rows = get(nvml.nvmlDeviceGetRemappedRows, h)  # (corrected, uncorrected, pending, failure)
            self.xids += self._new_xids()
            return GPUReading(
                temperature_c=get(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU),
                power_w=None if power is None else power / 1e3,  # NVML reports milliwatts
                power_limit_w=None if limit is None else limit / 1e3,
                memory_used_gb=None if memory is None else memory.used / 1e9,
                clock_event_reasons=get(nvml.nvmlDeviceGetCurrentClocksEventReasons, h),
                ecc_uncorrected=get(
                    nvml.nvmlDeviceGetTotalEccErrors,
                    h,
                    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    nvml.NVML_VOLATILE_ECC,
                ),
                rows_pending=bool(rows and rows[2]),
                rows_failed=bool(rows and rows[3]),
                pcie_replays=get(nvml.nvmlDeviceGetPcieReplayCounter, h),
                nvlink_errors={link: self._link_errors(link) for link in self.links},
                xids=tuple(self.xids),
            )
        except Exception as err:  # the poll thread must go on, and a lost GPU is itself the finding
            lost = getattr(err, "value", None) == nvml.NVML_ERROR_GPU_IS_LOST
            return GPUReading(error=f"{type(err).__name__}: {err}", gpu_lost=lost, xids=tuple(self.xids))

    def close(self) -> None:
        """Release the XID event set and this reader's NVML session."""
        if self.events is not None:
            self.nvml.nvmlEventSetFree(self.events)
        self.nvml.nvmlShutdown()

    def _optional(self, function: Any, *args: Any) -> Any:
        """`function(*args)`, or None where this GPU or driver does not expose it."""
        try:
            return function(*args)
        except self.nvml.NVMLError as err:
            if err.value in self.unexposed:
                return None
            raise

    def _link_active(self, link: int) -> bool:
        try:  # a GPU without NVLink, or past its last link, answers with an error
            return bool(self.nvml.nvmlDeviceGetNvLinkState(self.handle, link))
        except self.nvml.NVMLError:
            return False

    def _link_errors(self, link: int) -> int:
        """Replays, recoveries and CRC errors of one NVLink, summed (the counters it exposes)."""
        nvml = self.nvml
        counters = (
            nvml.NVML_NVLINK_ERROR_DL_REPLAY,
            nvml.NVML_NVLINK_ERROR_DL_RECOVERY,
            nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            nvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
        )
        return sum(
            self._optional(nvml.nvmlDeviceGetNvLinkErrorCounter, self.handle, link, c) or 0 for c in counters
        )

    def _watch_xids(self) -> Any:
        events = self.nvml.nvmlEventSetCreate()
        try:
            self.nvml.nvmlDeviceRegisterEvents(self.handle, self.nvml.nvmlEventTypeXidCriticalError, events)
        except self.nvml.NVMLError:
            self.nvml.nvmlEventSetFree(events)
            raise
        return events

    def _new_xids(self) -> list[int]:
        """Drain the XID events that arrived since the last poll, without waiting."""
        nvml, found = self.nvml, []
        if self.events is None:
            return found
        while True:
            try:
                event = nvml.nvmlEventSetWait_v2(self.events, 0)
            except nvml.NVMLError as err:
                if err.value == nvml.NVML_ERROR_TIMEOUT:
                    break
                raise
            if event.eventType & nvml.nvmlEventTypeXidCriticalError:
                found.append(int(event.eventData))
        return found


class GPUHealthMonitor(Callback):
    """Watch each rank's GPU through NVML (temperature, power, clock slowdowns, ECC, remapped rows,
    critical XIDs, PCIe and NVLink errors, memory) and act together on the worst rank's verdict:
    "warn" logs each new reason once; "stop" (a GPU that must not go on) saves a checkpoint and stops
    the run, or only logs with `on_fatal="warn"`. Logs `gpu/temperature_c`, `gpu/power_w`,
    `gpu/memory_used_gb` (max over ranks) and `gpu/health` (0 ok, 1 warn, 2 stop) at each check.

    `nvml`: a module with pynvml's names (default: import pynvml from nvidia-ml-py). `device_index`:
    the NVML index to watch; by default the GPU of this rank's CUDA device (found by PCI bus id), or,
    with `nvml` given and no CUDA device, the local rank.
    """

    def __init__(
        self,
        interval_s: float = 5.0,
        check_every_n_steps: int = 10,
        max_temperature_c: float = 85.0,
        max_power_fraction: float = 1.0,
        on_fatal: str = "stop",
        ignored_xids: Iterable[int] = APPLICATION_XIDS,
        nvml: Any = None,
        device_index: int | None = None,
    ) -> None:
        flags.check_number("interval_s", interval_s, 0, strict=True)
        flags.check_number("max_temperature_c", max_temperature_c, 0, strict=True)
        flags.check_number("max_power_fraction", max_power_fraction, 0, strict=True)
        flags.check_int("check_every_n_steps", check_every_n_steps, 1)
        if on_fatal not in ("stop", "warn"):
            raise ValueError(f"on_fatal={on_fatal!r} is invalid; allowed: 'stop' or 'warn'")
        ignored_xids = tuple(ignored_xids)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in ignored_xids):
            raise ValueError(f"ignored_xids={ignored_xids!r} is invalid; allowed: XID numbers (ints)")
        flags.check_int("device_index", device_index, 0, allow_none=True)
        self.interval_s, self.check_every_n_steps = float(interval_s), check_every_n_steps
        self.max_temperature_c, self.max_power_fraction = float(max_temperature_c), float(max_power_fraction)
        self.on_fatal, self.ignored_xids = on_fatal, frozenset(ignored_xids)
        self.nvml, self.device_index = nvml, device_index
        self._reader: NvmlReader | None = None
        self._policy: HealthPolicy | None = None
        self._start: GPUReading | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._latest: tuple[GPUReading, str, dict[str, str]] | None = None
        self._reported: set[str] = set()

    @property
    def active(self) -> bool:
        """Whether a GPU is being watched (between setup and teardown of a fit)."""
        return self._reader is not None

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if stage != "fit":
            return
        device = trainer.strategy.root_device
        if self.nvml is None and device.type != "cuda":
            where = (
                "this run trains on the CPU" if torch.cuda.is_available() else "no NVIDIA GPU on this machine"
            )
            rank_zero_info(f"GPUHealthMonitor: inactive ({where})")
            return
        problem = self._open(device)
        # every rank watches or none does: the checks are collectives
        problems = {
            r: p for r, p in enumerate(trainer.strategy.all_gather_object(problem, group="world")) if p
        }
        if problems:
            self._close()
            rank_zero_info(f"GPUHealthMonitor: inactive ({_by_rank(problems)})")
            return
        self._reported, self._stop = set(), threading.Event()
        self._thread = threading.Thread(
            target=self._poll,
            args=(self._reader, self._policy, self._start, self._stop),
            name="gpu-health",
            daemon=True,
        )
        self._thread.start()

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        if self._reader is None or trainer.global_step % self.check_every_n_steps:
            return
        reading, level, reasons = self._latest  # replaced whole by the poll thread, so no lock is needed
        new = {check: text for check, text in reasons.items() if check not in self._reported}
        local = [
            LEVELS.index(level),
            bool(new),
            reading.temperature_c,
            reading.power_w,
            reading.memory_used_gb,
        ]
        summary = torch.tensor(
            [-math.inf if v is None else float(v) for v in local], device=trainer.strategy.root_device
        )
        worst, any_new, *values = trainer.strategy.reduce(summary, "max", group="world").tolist()
        metrics = {name: v for name, v in zip(METRICS, values, strict=True) if v > -math.inf}
        trainer.log_metrics({**metrics, "gpu/health": worst})
        if any_new:
            self._report(trainer, level, new)
        if worst == LEVELS.index("stop") and self.on_fatal == "stop":
            trainer.save_and_stop("GPUHealthMonitor: a GPU is failing")

    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._close()

    def _open(self, device: torch.device) -> str | None:
        """Start NVML on this rank's GPU and take the starting reading; what went wrong, or None."""
        nvml = self.nvml
        if nvml is None:
            if not _NVML_AVAILABLE:
                return "nvidia-ml-py is not installed: pip install nvidia-ml-py"
            import pynvml as nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            return f"NVML did not start: {err}"
        try:
            reader = NvmlReader(nvml, self._handle(nvml, device))
        except nvml.NVMLError as err:
            nvml.nvmlShutdown()
            return f"NVML found no GPU for this rank: {err}"
        start = reader.read()
        if start.error:
            reader.close()
            return f"NVML could not read this rank's GPU: {start.error}"
        policy = HealthPolicy(
            slowdown_reasons(nvml), self.max_temperature_c, self.max_power_fraction, self.ignored_xids
        )
        self._reader, self._policy, self._start = reader, policy, start
        self._latest = (start, *policy.assess(start, start))
        return None

    def _handle(self, nvml: Any, device: torch.device) -> Any:
        """This rank's NVML device: by PCI bus id, since CUDA and NVML number GPUs differently."""
        if self.device_index is not None:
            return nvml.nvmlDeviceGetHandleByIndex(self.device_index)
        if device.type != "cuda":
            return nvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("LOCAL_RANK", 0)))
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        if getattr(props, "pci_bus_id", None) is None:  # a torch without PCI properties
            return nvml.nvmlDeviceGetHandleByIndex(index)
        return nvml.nvmlDeviceGetHandleByPciBusId(
            f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        )

    def _poll(
        self, reader: NvmlReader, policy: HealthPolicy, start: GPUReading, stop: threading.Event
    ) -> None:
        """The poll thread (it owns what it is given: teardown may drop the monitor's references first)."""
        while not stop.wait(self.interval_s):
            reading = reader.read()
            self._latest = (reading, *policy.assess(reading, start))

    def _report(self, trainer: Trainer, level: str, new: dict[str, str]) -> None:
        """Rank zero logs every rank's new reasons in one line; each reason is reported once per fit."""
        self._reported |= new.keys()
        gathered = trainer.strategy.all_gather_object((level, new), group="world")
        if not trainer.is_global_zero:
            return
        found = _by_rank(
            {rank: "; ".join(reasons.values()) for rank, (_, reasons) in enumerate(gathered) if reasons}
        )
        if any(lvl == "stop" for lvl, _ in gathered):
            action = (
                "saving a checkpoint and stopping"
                if self.on_fatal == "stop"
                else "going on (on_fatal='warn')"
            )
            log.error(f"GPUHealthMonitor: GPU failure at step {trainer.global_step}: {found}; {action}")
        else:
            log.warning(f"GPUHealthMonitor: GPU warning at step {trainer.global_step}: {found}")

    def _close(self) -> None:
        """Stop the poll thread, then release NVML (left open if a hung NVML call holds the thread)."""
        thread, self._thread = self._thread, None
        reader, self._reader = self._reader, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=10.0)
            if thread.is_alive():
                return
        if reader is not None:
            reader.close()


def _by_rank(messages: dict[int, str]) -> str:
    """'rank 0, 2: text | rank 1: other': ranks with the same message share one entry."""
    ranks_of: dict[str, list[int]] = {}
    for rank, message in messages.items():
        ranks_of.setdefault(message, []).append(rank)
    return " | ".join(f"rank {', '.join(map(str, ranks))}: {message}" for message, ranks in ranks_of.items())
