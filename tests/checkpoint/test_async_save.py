"""FSDPStrategy(async_save=True) writes a checkpoint in the background, against a disk the test controls.

DCP's file writer (`_FileSystemWriter.write_data`, what `dcp.async_save`'s background thread runs for a
checkpoint directory) is held on a `threading.Event` per checkpoint until the test releases it, so "the
files are not written yet" is a fact, not a race. A save that is synchronous writes on the training
thread, where holding it would hang; there the gate lets it through and notes it, and the test fails.

One run, in this process, in a one-rank gloo group made here on a FileStore (no TCP store, no port
chosen): FSDP ZeRO-2 on CPU, ModelCheckpoint every 2 steps (all kept), 6 steps.
- step 2's save must return while its files are held: step 3 runs with no checkpoint written (a);
- released after step 3, step-2 is complete by step 4's save (the next save finishes it), verifies,
  and holds the weights and AdamW state of step 2, not those of step 3 that training had reached (b);
- step 4's files are held until something waits on that save: step 6's save must wait for it, so
  step-4 is complete before step 6's files start (c);
- step 6's save is pending when the last step ends: fit must not return before it is complete (d).
"""

from __future__ import annotations

import os
import re
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import Regression, quiet, regression_loader
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from callbacks import Callback, ModelCheckpoint
from strategies import FSDPStrategy
from trainer import Trainer
from trainer import checkpoint as ckpt
from trainer.checkpoint import step_dir_name

STEPS, EVERY = 6, 2
STEP2, STEP4, STEP6 = (step_dir_name(s) for s in (2, 4, 6))
GUARD_S = 120.0  # only turns a hang (a bug) into a failure; no assertion depends on time


def complete(ckpt_dir: Path) -> set[str]:
    """Checkpoint directories that are complete: renamed into place with their meta.json."""
    if not ckpt_dir.is_dir():
        return set()
    return {
        p.name for p in ckpt_dir.iterdir() if p.name.startswith("step-") and (p / ckpt.META_FILE).exists()
    }


def checkpoint_of(writer_path: Any) -> str:
    """`.../.tmp-step-00000002-<run>-<pid>/dcp` -> `step-00000002`: the checkpoint a DCP writer writes."""
    return re.search(r"step-\d+", Path(writer_path).parent.name).group(0)


class SlowDisk:
    """Holds each checkpoint's DCP file writes until `release(name)`, and logs in order what happened:
    (checkpoint, "write starts" / "written" / "waited on", complete checkpoints at that moment)."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.ckpt_dir = ckpt_dir
        self.trainer_thread = threading.get_ident()
        self.gates: dict[str, threading.Event] = defaultdict(threading.Event)
        self.started: dict[str, threading.Event] = defaultdict(threading.Event)
        self.written: dict[str, threading.Event] = defaultdict(threading.Event)
        self.log: list[tuple[str, str, set[str]]] = []
        self.on_training_thread: list[str] = []
        self._lock = threading.Lock()

    def note(self, name: str, what: str) -> None:
        with self._lock:
            self.log.append((name, what, complete(self.ckpt_dir)))

    def release(self, name: str) -> None:
        self.gates[name].set()

    def release_all(self) -> None:
        for gate in list(self.gates.values()):
            gate.set()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        write_data, async_save = _FileSystemWriter.write_data, dcp.async_save

        def held_write_data(writer, plan, planner):
            name = checkpoint_of(writer.path)
            self.note(name, "write starts")
            self.started[name].set()
            if threading.get_ident() == self.trainer_thread:
                self.on_training_thread.append(name)  # synchronous: nobody else could release it
            elif not self.gates[name].wait(GUARD_S):
                raise RuntimeError(f"the test never released {name}")
            result = write_data(writer, plan, planner)
            self.note(name, "written")
            self.written[name].set()
            return result

        def async_save_released_on_wait(*args, **kwargs):
            # the save's files stay held until the trainer waits for this save (or the test releases them)
            name = checkpoint_of(kwargs["storage_writer"].path)
            self.gates[name]  # the gate exists (closed) from the save on
            return _ReleasedOnWait(async_save(*args, **kwargs), self, name)

        monkeypatch.setattr(_FileSystemWriter, "write_data", held_write_data)
        monkeypatch.setattr(dcp, "async_save", async_save_released_on_wait)


class _ReleasedOnWait:
    """dcp.async_save's future; `result()` (the trainer waiting for the save) first releases its files."""

    def __init__(self, future: Any, disk: SlowDisk, name: str) -> None:
        self._future, self._disk, self._name = future, disk, name

    def result(self, timeout: float | None = None) -> Any:
        self._disk.note(self._name, "waited on")
        self._disk.release(self._name)
        return self._future.result(timeout)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._future, attr)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class Probe(Callback):
    """Looks at the disk around the saves (placed after ModelCheckpoint) and drives the releases."""

    def __init__(self, disk: SlowDisk, ckpt_dir: Path) -> None:
        self.disk, self.ckpt_dir = disk, ckpt_dir
        self.seen: dict[str, Any] = {}
        self.saved_state: dict[str, Any] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 2:  # step 3 starts after step 2's save returned
            writing = self.disk.started[STEP2].wait(GUARD_S)  # the background writer reached the disk
            staged = sorted(self.ckpt_dir.glob(f".tmp-{STEP2}-*/dcp"))  # named for its owner: one
            self.seen["step 3 starts"] = {
                "writer reached the disk": writing,
                "complete": complete(self.ckpt_dir),
                "dcp files": sorted(os.listdir(staged[0])) if len(staged) == 1 else [],
                "in progress": trainer.strategy.checkpoint_in_progress,
            }

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == 2:  # what step 2's checkpoint must hold, read from the live model and optimizer
            named = dict(module.named_parameters())
            self.saved_state = {
                "model": {name: full(p) for name, p in named.items()},
                "optim": {
                    name: {k: full(v) for k, v in trainer.optimizer.state[p].items()}
                    for name, p in named.items()
                },
            }
        if step == 3:  # step 3 ran while step 2's files were held; now let them be written
            self.seen["step 3 ends"] = {
                "complete": complete(self.ckpt_dir),
                "written": self.disk.written[STEP2].is_set(),
            }
            self.disk.release(STEP2)
            self.seen["released step-2, written"] = self.disk.written[STEP2].wait(GUARD_S)
        if step in (4, 6):
            self.seen[f"step {step} saved"] = complete(self.ckpt_dir)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """The run described at the top, in a one-rank gloo group; returns (disk, probe, after_fit, ckpt_dir)."""
    root = tmp_path_factory.mktemp("async-save")
    ckpt_dir = root / "checkpoints"
    disk = SlowDisk(ckpt_dir)
    with pytest.MonkeyPatch.context() as mp:
        # a world of one that exists already: the strategy joins it and creates no store of its own
        for key, value in {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",  # required by the world's description; never bound (the group exists)
        }.items():
            mp.setenv(key, value)
        assert not dist.is_initialized(), "an earlier test left a process group in this process"
        dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 1), rank=0, world_size=1)
        disk.install(mp)
        probe = Probe(disk, ckpt_dir)
        try:
            torch.manual_seed(0)
            trainer = Trainer(
                strategy=FSDPStrategy(zero_stage=2, async_save=True),
                accelerator="cpu",
                devices=1,
                max_steps=STEPS,
                seed=0,
                default_root_dir=root,
                callbacks=[ModelCheckpoint(every_n_steps=EVERY, save_top_k=-1), probe],
                **quiet(),
            )
            trainer.fit(Regression(), regression_loader(shuffle=True))
            after_fit = {
                "complete": complete(ckpt_dir),
                "in progress": trainer.strategy.checkpoint_in_progress,
                "pending gates": sorted(n for n, g in disk.gates.items() if not g.is_set()),
            }
        finally:
            disk.release_all()  # nothing stays blocked, whatever failed
            dist.destroy_process_group()
    return disk, probe, after_fit, ckpt_dir


def test_the_save_returns_and_training_goes_on_before_the_files_are_written(async_run):
    disk, probe, _, _ = async_run
    assert disk.started[STEP2].is_set(), "the checkpoint was not written through DCP's FileSystemWriter"
    at_step3 = probe.seen["step 3 starts"]
    assert STEP2 not in at_step3["complete"], (
        "step 2's checkpoint was complete before step 3: the save blocked"
    )
    assert disk.on_training_thread == [], f"{disk.on_training_thread} were written on the training thread"
    assert at_step3["writer reached the disk"]
    assert not any(f.endswith(".distcp") or f == ".metadata" for f in at_step3["dcp files"]), at_step3
    assert at_step3["in progress"]
    # step 3 trained (its forward, backward and update) while the files were still held
    assert probe.seen["step 3 ends"] == {"complete": set(), "written": False}


def test_released_the_checkpoint_completes_and_holds_the_state_of_its_step(async_run):
    _, probe, _, ckpt_dir = async_run
    assert probe.seen["released step-2, written"]
    assert STEP2 in probe.seen["step 4 saved"], "step-2 was not completed by the next save"
    meta = ckpt.check_good(ckpt_dir / STEP2)  # every file of the manifest, its size and hashes
    assert meta["step"] == 2 and meta["format"] == "dcp"
    assert (ckpt_dir / STEP2 / ckpt.VALIDATED_FILE).exists(), "ModelCheckpoint did not validate (reload) it"
    # read back with DCP's own converter (no process group, nothing of the trainer's loading code)
    dcp_to_torch_save(ckpt_dir / STEP2 / "dcp", ckpt_dir.parent / "step2.pt")
    step2 = torch.load(ckpt_dir.parent / "step2.pt", weights_only=True)
    expected = probe.saved_state
    assert sorted(step2["model"]) == sorted(expected["model"])
    for name, value in expected["model"].items():
        assert torch.equal(step2["model"][name], value), f"{name} is not the weight of step 2"
    for name, state in expected["optim"].items():
        assert sorted(step2["optim"]["state"][name]) == sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
        for key, value in state.items():
            assert torch.equal(step2["optim"]["state"][name][key], value), (
                f"{name}.{key} is not that of step 2"
            )


def test_the_next_save_waits_for_the_previous_one(async_run):
    disk, probe, _, _ = async_run
    # step-4's files are held until something waits on that save; step 6's files must start after it completed
    when_step6_starts = next(
        (done for name, what, done in disk.log if (name, what) == (STEP6, "write starts")), None
    )
    assert when_step6_starts is not None, "step 6's files were never written"
    assert STEP4 in when_step6_starts, (
        f"step 6's save started while step-4 was incomplete ({when_step6_starts})"
    )
    order = [(name, what) for name, what, _ in disk.log]
    assert (STEP4, "waited on") in order, (
        "nothing waited for step 4's save (not pending at step 6: synchronous?)"
    )
    assert (
        order.index((STEP4, "waited on"))
        < order.index((STEP4, "written"))
        < order.index((STEP6, "write starts"))
    )
    assert probe.seen["step 4 saved"] == {STEP2}  # step-4 itself still held then
    assert probe.seen["step 6 saved"] == {STEP2, STEP4}


def test_the_end_of_fit_waits_for_the_pending_save(async_run):
    _, _, after_fit, ckpt_dir = async_run
    assert after_fit["pending gates"] == [], "fit returned with a save still held on the disk"
    assert after_fit["complete"] == {STEP2, STEP4, STEP6} and not after_fit["in progress"]
    assert ckpt.check_good(ckpt_dir / STEP6)["step"] == 6
    assert (ckpt_dir / STEP6 / ckpt.VALIDATED_FILE).exists()
    assert not [p.name for p in ckpt_dir.iterdir() if p.name.startswith(".")], "temporary directories left"
