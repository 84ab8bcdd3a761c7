"""Fixtures every test gets: a seeded RNG, no launcher variables, and caches inside the test's temp dir."""

from __future__ import annotations

import os
import random
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import preloaded
import pytest
import torch
from helpers import LAUNCHER_KEYS, RANK_SLOTS, RESOLVER, SEED, SESSION_ENV

from trainer.core.launch import destroy_process_group
from trainer.core.rng import SEED_ENV

XDIST_FORK = Path(__file__).with_name("xdist_fork.py")

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for _key, _value in RESOLVER.items():  # the stores this process connects to itself (the test's own groups)
    os.environ.setdefault(_key, _value)
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist's controller starts the preloading server its workers share (tests/preloaded.py)."""
    controller = config.getoption("numprocesses", None) and not hasattr(config, "workerinput")
    if controller and not config.option.collectonly:
        preloaded.start_shared(SESSION_ENV)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config: pytest.Config, specs: list) -> None:
    """pytest-xdist's workers on this machine start as forks of that server (tests/xdist_fork.py)."""
    if preloaded.SHARED in os.environ:
        for spec in specs:
            if spec.popen and not spec.python:
                spec.python = shlex.join([sys.executable, str(XDIST_FORK)])


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test: the same seed for torch and `random`, no torchrun/SLURM variables, and the working
    directory and the token cache under the test's own temp dir: a default path (./runs) or a cache
    write never lands in the repository or ~/.cache/trainer. Afterwards no process group is left: a fit of
    a mesh strategy in the test's own process keeps one up for the process's next fit, and under
    pytest-xdist the next test of that worker may be one that builds its own group."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(SEED)
    random.seed(SEED)
    for key in (*LAUNCHER_KEYS, SEED_ENV):  # nor the sampling seed an earlier test's seed_everything left
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TRAINER_CACHE", str(tmp_path / "trainer-cache"))
    yield
    if torch.distributed.is_initialized():
        destroy_process_group()


@pytest.fixture(autouse=True, scope="session")
def _shared_rank_slots(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Under pytest-xdist: the lock file through which the workers take turns at wide launches
    (`helpers.rank_slots`), in the session's temp dir that every worker's own temp dir sits in."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[RANK_SLOTS] = str(tmp_path_factory.getbasetemp().parent / "rank-slots.lock")


# The modules that take longest under `make test` (their tests' seconds, measured 2026-12-03: 136 down to 22
# s), longest first. They run first: pytest-xdist hands each worker the next module as it finishes one, so the
# short modules then fill the end of the run instead of one worker finishing a long module alone.
LONG_POLES = (
    "hf/test_hf_matrix.py", "distributed/test_ddp.py", "distributed/test_fsdp.py", "distributed/test_parallel3d.py",
    "distributed/test_fault_drill.py", "distributed/test_expert_parallel.py", "lightning/test_lightning_parity.py",
    "distributed/test_fault_tolerance.py", "observability/test_gpu_bench.py", "hf/test_hf_recipes.py",
    "distributed/test_collective_count.py", "distributed/test_fault_tolerance_launch.py",
    "checkpoint/test_zero1_checkpoint.py", "distributed/test_moe_memory_plan.py", "observability/test_profiler.py",
    "cli/test_cli.py", "cli/test_doctor.py", "distributed/test_compile.py", "lightning/test_lightning_examples.py",
    "distributed/test_manual_optimization_ddp.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The LONG_POLES modules' tests first, longest module first; the rest keep their order (`make test`
    passes --no-loadscope-reorder so that xdist keeps this one)."""

    def place(item: pytest.Item) -> int:
        path = item.path.as_posix()
        return next((i for i, name in enumerate(LONG_POLES) if path.endswith(name)), len(LONG_POLES))

    items.sort(key=place)  # stable: within a module, and among the rest, the collection's order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report names the seed it ran with (TRAINER_TEST_SEED reruns it)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("seed", f"TRAINER_TEST_SEED={SEED}"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "run"
