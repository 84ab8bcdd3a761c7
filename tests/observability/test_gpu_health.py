"""GPUHealthMonitor: the verdict on NVML readings, agreement over ranks, and the no-GPU no-op.

CI has no NVIDIA GPU, so NVML is played by FakeNVML: pynvml's names and constant values (checked
against pynvml when it is installed) returning readings as an H100 SXM 80GB in training reports them.
"""

from __future__ import annotations

import logging
import re
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import TESTS, Regression, quiet, read_metrics, regression_loader, run_ranks

from callbacks import Callback
from callbacks.gpu_health import GPUHealthMonitor, HealthPolicy, NvmlReader, slowdown_reasons
from trainer import Trainer
from trainer.checkpoint import find_last_good


def h100(**changes) -> dict:
    """Raw NVML values of a healthy H100 SXM 80GB in steady training (milliwatts, bytes, bit masks)."""
    state = {
        "temperature": 64,
        "power_mw": 612_480,
        "power_limit_mw": 700_000,
        "memory": SimpleNamespace(total=85_520_809_984, used=71_476_379_648, free=14_044_430_336),
        "clock_reasons": 0x0,
        "ecc": {(1, 0): 0, (0, 0): 0},  # (error type, counter type) -> count; 1 = uncorrected, 0 = volatile
        "remapped_rows": (0, 0, 0, 0),  # corrected, uncorrected, pending, failure
        "pcie_replays": 0,
        "nvlink": {link: {} for link in range(18)},  # active link -> {error counter: count}
        "xid_events": [],  # critical XIDs waiting in the event set
    }
    return {**state, **changes}


class FakeNVML:
    """The part of pynvml the monitor uses, playing one GPU from `state`: a value None answers
    "Not Supported" and an NVMLError instance is raised, as a GPU without that reading or a failing
    one would. Counts polls (one temperature read each) and records which thread polled."""

    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_NVLINK_MAX_LINKS = 36
    NVML_NVLINK_ERROR_DL_REPLAY = 0
    NVML_NVLINK_ERROR_DL_RECOVERY = 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
    NVML_NVLINK_ERROR_DL_CRC_DATA = 3
    NVML_ERROR_INVALID_ARGUMENT = 2
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_ERROR_GPU_IS_LOST = 15
    nvmlEventTypeXidCriticalError = 0x8
    nvmlClocksEventReasonGpuIdle = 0x1
    nvmlClocksEventReasonApplicationsClocksSetting = 0x2
    nvmlClocksEventReasonSwPowerCap = 0x4
    nvmlClocksEventReasonHwSlowdown = 0x8
    nvmlClocksEventReasonSyncBoost = 0x10
    nvmlClocksEventReasonSwThermalSlowdown = 0x20
    nvmlClocksEventReasonHwThermalSlowdown = 0x40
    nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
    nvmlClocksEventReasonDisplayClockSetting = 0x100
    MESSAGES = {3: "Not Supported", 9: "Driver Not Loaded", 10: "Timeout", 15: "GPU is lost"}

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(FakeNVML.MESSAGES.get(value, f"NVML error {value}"))
            self.value = value

    def __init__(self, state: dict, init_error: int | None = None) -> None:
        self.state, self.init_error = state, init_error
        self.sessions = self.polls = 0
        self.poll_threads: list[str] = []
        self.handles: list[tuple[str, object]] = []
        self.event_sets_open = 0

    def change(self, **values) -> None:
        """Set new readings and return once two polls have begun since (so one saw them whole)."""
        self.state.update(values)
        target, deadline = self.polls + 2, time.monotonic() + 10
        while self.polls < target and time.monotonic() < deadline:
            time.sleep(0.002)
        assert self.polls >= target, "the monitor stopped polling"

    def _get(self, key: str):
        value = self.state[key]
        if value is None:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        if isinstance(value, Exception):
            raise value
        return value

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.NVMLError(self.init_error)
        self.sessions += 1

    def nvmlShutdown(self) -> None:
        self.sessions -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.handles.append(("index", index))
        return "gpu"

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> str:
        self.handles.append(("pci", bus_id))
        return "gpu"

    def nvmlDeviceGetTemperature(self, handle, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        self.polls += 1
        self.poll_threads.append(threading.current_thread().name)
        return self._get("temperature")

    def nvmlDeviceGetPowerUsage(self, handle) -> int:
        return self._get("power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle) -> int:
        return self._get("power_limit_mw")

    def nvmlDeviceGetMemoryInfo(self, handle):
        return self._get("memory")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle) -> int:
        return self._get("clock_reasons")

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type: int, counter_type: int) -> int:
        return self._get("ecc")[(error_type, counter_type)]

    def nvmlDeviceGetRemappedRows(self, handle) -> tuple[int, int, int, int]:
        return self._get("remapped_rows")

    def nvmlDeviceGetPcieReplayCounter(self, handle) -> int:
        return self._get("pcie_replays")

    def nvmlDeviceGetNvLinkState(self, handle, link: int) -> int:
        if link not in self._get("nvlink"):
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, handle, link: int, counter: int) -> int:
        return self._get("nvlink")[link].get(counter, 0)

    def nvmlEventSetCreate(self) -> str:
        self.event_sets_open += 1
        return "events"

    def nvmlEventSetFree(self, events) -> None:
        self.event_sets_open -= 1

    def nvmlDeviceRegisterEvents(self, handle, event_types: int, events) -> None:
        assert event_types == self.nvmlEventTypeXidCriticalError
        self._get("xid_events")

    def nvmlEventSetWait_v2(self, events, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0, "the poll thread must not block on events"
        pending = self._get("xid_events")
        if not pending:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT)
        return SimpleNamespace(eventType=self.nvmlEventTypeXidCriticalError, eventData=pending.pop(0))


class AtStep(Callback):
    """Runs `action` at the end of optimizer step `step` (listed before the monitor: before its check)."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action = step, action

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.action()


@pytest.fixture
def trainer_log():
    """Records of the "trainer" logger (attached directly: the console set-up may stop propagation)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("trainer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # as on rank zero, also where no Trainer has set it yet
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def messages(records: list[logging.LogRecord], level: int) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == level and "GPUHealthMonitor" in r.getMessage()]


def judge(later: dict, start: dict | None = None, **limits) -> tuple[str, dict[str, str]]:
    """Read a fake GPU at `start`, change it to `later`, read again and judge the second reading."""
    fake = FakeNVML(start or h100())
    reader = NvmlReader(fake, "gpu")
    first = reader.read()
    fake.state.update(later)
    return HealthPolicy(slowdown_reasons(fake), **limits).assess(reader.read(), first)


LOST = FakeNVML.NVMLError(FakeNVML.NVML_ERROR_GPU_IS_LOST)
SCENARIOS = {
    # name: (later readings, start readings (None: healthy h100), level, {check: words in its reason})
    "healthy": ({"temperature": 66, "power_mw": 655_010}, None, "ok", {}),
    "sw_power_cap_and_idle_are_normal": ({"clock_reasons": 0x4 | 0x1}, None, "ok", {}),
    "sync_boost_and_app_clocks_are_normal": ({"clock_reasons": 0x10 | 0x2}, None, "ok", {}),
    "overheating_and_thermally_throttled": (
        {"temperature": 91, "clock_reasons": 0x8 | 0x20 | 0x40},
        None,
        "warn",
        {"temperature": "temperature 91 C", "clocks": "HW thermal slowdown"},
    ),
    "power_brake": ({"clock_reasons": 0x8 | 0x80}, None, "warn", {"clocks": "HW power brake"}),
    "power_above_the_limit": ({"power_mw": 742_300}, None, "warn", {"power": "power 742 W"}),
    "uncorrected_ecc_increase": (
        {"ecc": {(1, 0): 2, (0, 0): 0}},
        None,
        "stop",
        {"ecc": "2 uncorrected ECC error(s)"},
    ),
    "uncorrected_ecc_from_before_the_run": (
        {},
        h100(ecc={(1, 0): 1, (0, 0): 0}),
        "ok",
        {},
    ),
    "corrected_ecc_is_normal": ({"ecc": {(1, 0): 0, (0, 0): 57}}, None, "ok", {}),
    "remapped_rows_pending": (
        {"remapped_rows": (0, 1, 1, 0)},
        None,
        "stop",
        {"remapped_rows": "needs a reset"},
    ),
    "rows_remapped_at_an_earlier_reset_are_normal": ({"remapped_rows": (2, 1, 0, 0)}, None, "ok", {}),
    "remapped_rows_failed": (
        {"remapped_rows": (0, 0, 0, 1)},
        None,
        "stop",
        {"remapped_rows": "replace this GPU"},
    ),
    "critical_xid": ({"xid_events": [95]}, None, "stop", {"xid": "XID error(s) 95"}),
    "application_xid_is_not_a_gpu_fault": ({"xid_events": [13]}, None, "ok", {}),
    "pcie_replays": ({"pcie_replays": 37}, None, "warn", {"pcie": "PCIe replay counter +37"}),
    "nvlink_errors": (
        {"nvlink": {**h100()["nvlink"], 3: {2: 12}}},
        None,
        "warn",
        {"nvlink": "link(s) 3"},
    ),
    "gpu_without_ecc_remapping_nvlink_or_events": (
        {"temperature": 70},
        h100(ecc=None, remapped_rows=None, pcie_replays=None, nvlink=None, xid_events=None),
        "ok",
        {},
    ),
    "gpu_lost": ({"temperature": LOST}, None, "stop", {"gpu_lost": "GPU is lost"}),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_recorded_condition_gets_its_level_and_a_reason_naming_it(name):
    later, start, level, expected = SCENARIOS[name]
    got_level, reasons = judge(later, start)
    assert (got_level, set(reasons)) == (level, set(expected)), reasons
    for check, words in expected.items():
        assert words in reasons[check]


def test_a_critical_xid_stays_in_the_verdict_after_its_poll():
    fake = FakeNVML(h100(xid_events=[79]))
    reader = NvmlReader(fake, "gpu")
    reader.read()
    assert reader.read().xids == (79,)  # the training thread may only look a few polls later


def test_thresholds_are_configurable():
    hot = {"temperature": 88, "power_mw": 690_000}
    assert judge(hot)[0] == "warn"
    assert judge(hot, max_temperature_c=90)[0] == "ok"
    assert set(judge(hot, max_power_fraction=0.95)[1]) == {"temperature", "power"}


def test_a_fatal_gpu_error_mid_run_saves_a_checkpoint_and_stops(tmp_path, trainer_log):
    fake = FakeNVML(h100())
    failure = AtStep(12, lambda: fake.change(ecc={(1, 0): 2, (0, 0): 0}))
    monitor = GPUHealthMonitor(nvml=fake, interval_s=0.01, check_every_n_steps=5)
    trainer = Trainer(
        max_steps=40,
        default_root_dir=tmp_path,
        callbacks=[failure, monitor],
        enable_checkpointing=False,
        **quiet(),
    )
    trainer.fit(Regression(), regression_loader())
    assert trainer.global_step == 15  # the first check after the failure
    assert find_last_good(tmp_path / "checkpoints") == (tmp_path / "checkpoints" / "step-00000015", [])
    assert messages(trainer_log, logging.ERROR) == [
        "GPUHealthMonitor: GPU failure at step 15: rank 0: 2 uncorrected ECC error(s) in GPU memory since "
        "monitoring started; saving a checkpoint and stopping"
    ]
    assert read_metrics(tmp_path, "gpu/health") == {5: 0, 10: 0, 15: 2}
    assert fake.sessions == 0 and fake.event_sets_open == 0 and not monitor.active


def test_a_healthy_gpu_is_polled_off_the_training_thread_and_its_readings_logged(tmp_path, trainer_log):
    fake = FakeNVML(h100())
    warmer = AtStep(7, lambda: fake.change(temperature=71))
    monitor = GPUHealthMonitor(nvml=fake, interval_s=0.01, check_every_n_steps=5)
    trainer = Trainer(
        max_steps=20,
        default_root_dir=tmp_path,
        callbacks=[warmer, monitor],
        enable_checkpointing=False,
        **quiet(),
    )
    trainer.fit(Regression(), regression_loader())
    assert trainer.global_step == 20
    assert read_metrics(tmp_path, "gpu/temperature_c") == {5: 64.0, 10: 71.0, 15: 71.0, 20: 71.0}
    assert read_metrics(tmp_path, "gpu/power_w") == pytest.approx({s: 612.48 for s in (5, 10, 15, 20)})
    assert read_metrics(tmp_path, "gpu/memory_used_gb") == pytest.approx(
        {s: 71.476 for s in (5, 10, 15, 20)}, abs=1e-3
    )
    assert read_metrics(tmp_path, "gpu/health") == {5: 0, 10: 0, 15: 0, 20: 0}
    assert fake.poll_threads[0] == "MainThread" and set(fake.poll_threads[1:]) == {"gpu-health"}
    assert messages(trainer_log, logging.WARNING) == messages(trainer_log, logging.ERROR) == []
    assert fake.sessions == 0 and "gpu-health" not in [t.name for t in threading.enumerate()]


def test_a_warning_is_logged_once_per_reason_and_the_run_goes_on(tmp_path, trainer_log):
    fake = FakeNVML(h100())
    heat = AtStep(3, lambda: fake.change(temperature=91))
    throttle = AtStep(12, lambda: fake.change(clock_reasons=0x48))
    monitor = GPUHealthMonitor(nvml=fake, interval_s=0.01, check_every_n_steps=5)
    trainer = Trainer(
        max_steps=25,
        default_root_dir=tmp_path,
        callbacks=[heat, throttle, monitor],
        enable_checkpointing=False,
        **quiet(),
    )
    trainer.fit(Regression(), regression_loader())
    assert trainer.global_step == 25
    assert messages(trainer_log, logging.WARNING) == [
        "GPUHealthMonitor: GPU warning at step 5: rank 0: temperature 91 C is above max_temperature_c=85",
        "GPUHealthMonitor: GPU warning at step 15: rank 0: clocks slowed by HW slowdown, HW thermal slowdown "
        "(event reasons 0x48)",
    ]
    assert read_metrics(tmp_path, "gpu/health") == {5: 1, 10: 1, 15: 1, 20: 1, 25: 1}


def test_on_fatal_warn_reports_the_failure_once_and_trains_on(tmp_path, trainer_log):
    fake = FakeNVML(h100())
    failure = AtStep(2, lambda: fake.change(xid_events=[48]))
    monitor = GPUHealthMonitor(nvml=fake, interval_s=0.01, check_every_n_steps=5, on_fatal="warn")
    trainer = Trainer(
        max_steps=15,
        default_root_dir=tmp_path,
        callbacks=[failure, monitor],
        enable_checkpointing=False,
        **quiet(),
    )
    trainer.fit(Regression(), regression_loader())
    assert trainer.global_step == 15
    assert messages(trainer_log, logging.ERROR) == [
        "GPUHealthMonitor: GPU failure at step 5: rank 0: critical XID error(s) 48; going on (on_fatal='warn')"
    ]
    assert not (tmp_path / "checkpoints").exists()


def test_without_a_gpu_it_says_so_once_and_does_nothing(tmp_path, trainer_log):
    threads: list[str] = []
    probe = AtStep(2, lambda: threads.extend(t.name for t in threading.enumerate()))
    monitor = GPUHealthMonitor(check_every_n_steps=1)
    trainer = Trainer(
        accelerator="cpu", max_steps=3, default_root_dir=tmp_path, callbacks=[probe, monitor], **quiet()
    )
    trainer.fit(Regression(), regression_loader())
    why = "this run trains on the CPU" if torch.cuda.is_available() else "no NVIDIA GPU on this machine"
    assert messages(trainer_log, logging.INFO) == [f"GPUHealthMonitor: inactive ({why})"]
    assert [r for r in trainer_log if r.levelno >= logging.WARNING] == []
    assert trainer.global_step == 3 and "gpu-health" not in threads and not monitor.active
    assert read_metrics(tmp_path, "gpu/health") == {}


def stub_trainer(device: torch.device, problems_elsewhere: dict[int, str] | None = None) -> SimpleNamespace:
    """Just what setup reads: the device, and every rank's answer to "could you open NVML?"."""

    def all_gather_object(obj, *, group):
        assert group == "world", group
        gathered = [obj]
        for rank, problem in sorted((problems_elsewhere or {}).items()):
            gathered.insert(rank, problem)
        return gathered

    return SimpleNamespace(strategy=SimpleNamespace(root_device=device, all_gather_object=all_gather_object))


def test_a_missing_nvidia_ml_py_is_named_with_the_install_command(monkeypatch, trainer_log):
    monkeypatch.setattr("callbacks.gpu_health._NVML_AVAILABLE", False)  # the RequirementCache's answer
    monitor = GPUHealthMonitor()
    monitor.setup(stub_trainer(torch.device("cuda", 0)), None, "fit")
    assert messages(trainer_log, logging.INFO) == [
        "GPUHealthMonitor: inactive (rank 0: nvidia-ml-py is not installed: pip install nvidia-ml-py)"
    ]
    assert not monitor.active


def test_nvml_that_fails_on_one_rank_leaves_every_rank_inactive(trainer_log):
    fake = FakeNVML(h100())
    monitor = GPUHealthMonitor(nvml=fake)
    monitor.setup(
        stub_trainer(torch.device("cpu"), {1: "NVML did not start: Driver Not Loaded"}), None, "fit"
    )
    assert not monitor.active and fake.sessions == 0 and fake.event_sets_open == 0
    assert messages(trainer_log, logging.INFO) == [
        "GPUHealthMonitor: inactive (rank 1: NVML did not start: Driver Not Loaded)"
    ]
    failing = GPUHealthMonitor(nvml=FakeNVML(h100(), init_error=FakeNVML.NVML_ERROR_DRIVER_NOT_LOADED))
    failing.setup(stub_trainer(torch.device("cpu")), None, "fit")
    assert not failing.active
    assert messages(trainer_log, logging.INFO)[-1] == (
        "GPUHealthMonitor: inactive (rank 0: NVML did not start: Driver Not Loaded)"
    )


def test_a_cuda_rank_watches_the_gpu_with_its_pci_bus_id(monkeypatch):
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props if index == 1 else None)
    fake = FakeNVML(h100())
    monitor = GPUHealthMonitor(nvml=fake, interval_s=60)
    monitor.setup(stub_trainer(torch.device("cuda", 1)), None, "fit")
    monitor.teardown(None, None, "fit")
    assert fake.handles == [("pci", "00000000:3B:00.0")]  # NVML's own bus id format
    assert fake.sessions == 0


def test_without_cuda_an_injected_nvml_watches_the_local_rank_or_device_index(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    for kwargs, expected in (({}, ("index", 3)), ({"device_index": 5}, ("index", 5))):
        fake = FakeNVML(h100())
        monitor = GPUHealthMonitor(nvml=fake, interval_s=60, **kwargs)
        monitor.setup(stub_trainer(torch.device("cpu")), None, "fit")
        assert monitor.active
        monitor.teardown(None, None, "fit")
        assert fake.handles == [expected] and not monitor.active


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"interval_s": 0}, "interval_s=0 is invalid; allowed: a number > 0"),
        ({"interval_s": "5"}, "interval_s='5' is invalid; allowed: a number > 0"),
        ({"check_every_n_steps": 0}, "check_every_n_steps=0 is invalid; allowed: an int >= 1"),
        ({"check_every_n_steps": 2.5}, "check_every_n_steps=2.5 is invalid; allowed: an int >= 1"),
        ({"max_temperature_c": -1}, "max_temperature_c=-1 is invalid; allowed: a number > 0"),
        ({"max_power_fraction": 0.0}, "max_power_fraction=0.0 is invalid; allowed: a number > 0"),
        ({"on_fatal": "crash"}, "on_fatal='crash' is invalid; allowed: 'stop' or 'warn'"),
        ({"ignored_xids": ["13"]}, "ignored_xids=('13',) is invalid; allowed: XID numbers (ints)"),
        ({"device_index": -1}, "device_index=-1 is invalid; allowed: an int >= 0 or None"),
    ],
)
def test_bad_arguments_are_named_with_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GPUHealthMonitor(**kwargs)


def test_the_fake_has_pynvml_names_and_values():
    pynvml = pytest.importorskip("pynvml")
    names = [n for n in vars(FakeNVML) if n.startswith(("NVML_", "nvml"))]
    missing = [n for n in names if not hasattr(pynvml, n)]
    assert missing == []
    wrong = {n: getattr(FakeNVML, n) for n in names if isinstance(getattr(FakeNVML, n), int)}
    assert {n: v for n, v in wrong.items() if getattr(pynvml, n) != v} == {}
    assert FakeNVML.NVMLError(15).value == pynvml.NVMLError(15).value and str(LOST) == str(
        pynvml.NVMLError(15)
    )


DDP_SCRIPT = """
import argparse, os, sys
sys.path[:0] = [{tests!r}, {here!r}]  # helpers, and this test file's fakes
from helpers import Regression, regression_loader
from test_gpu_health import AtStep, FakeNVML, h100
from callbacks.gpu_health import GPUHealthMonitor
from strategies import DDPStrategy
from trainer import Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, required=True)
args = parser.parse_args()
fake = FakeNVML(h100())
callbacks = [GPUHealthMonitor(nvml=fake, interval_s=0.01, check_every_n_steps=5)]
if os.environ.get("RANK") == "1":
    callbacks.insert(0, AtStep(7, lambda: fake.change(remapped_rows=(0, 1, 1, 0))))
trainer = Trainer(
    strategy=DDPStrategy(timeout_s=30),  # a rank left out of a collective fails the job, not hangs it
    devices=args.devices,
    accelerator="cpu",
    max_steps=30,
    default_root_dir={root!r},
    callbacks=callbacks,
    enable_checkpointing=False,
    enable_progress_bar=False,
)
trainer.fit(Regression(), regression_loader())
print(f"rank {{trainer.strategy.global_rank}} stopped at step {{trainer.global_step}}")
"""


@pytest.mark.slow
def test_a_failing_gpu_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    script = tmp_path / "two_ranks.py"
    here = str(Path(__file__).parent)
    script.write_text(textwrap.dedent(DDP_SCRIPT).format(tests=str(TESTS), here=here, root=str(tmp_path)))
    done = run_ranks(2, script, timeout=90)
    # two processes share the pipe: with PYTHONUNBUFFERED a line's text and its newline can interleave
    stopped = sorted(re.findall(r"rank \d stopped at step \d+", done.stdout))
    assert stopped == ["rank 0 stopped at step 10", "rank 1 stopped at step 10"], done.stdout
    assert (
        "GPUHealthMonitor: GPU failure at step 10: rank 1: memory rows are pending remapping: this GPU needs a "
        "reset; saving a checkpoint and stopping"
    ) in done.stderr
    assert find_last_good(tmp_path / "checkpoints") == (tmp_path / "checkpoints" / "step-00000010", [])
