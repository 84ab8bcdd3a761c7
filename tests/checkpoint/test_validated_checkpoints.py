"""Validated checkpoints: manifests, reload-and-compare validation, and "last" skipping bad checkpoints."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from helpers import FakeClock, Regression, fake_time, fit, quiet, regression_loader

from callbacks import Callback, ModelCheckpoint
from strategies import SingleDeviceStrategy
from trainer import Trainer
from trainer import checkpoint as ckpt
from trainer.checkpoint.integrity import hash_file


def run(root, steps, callbacks=(), ckpt_path=None, strategy="auto", val_loader=None):
    torch.manual_seed(0)  # the same initial weights in every run of a test
    module = Regression(dropout=0.1)
    trainer = fit(
        module,
        regression_loader(shuffle=True),
        root,
        steps,
        val_loader=val_loader,
        ckpt_path=ckpt_path,
        strategy=strategy,
        callbacks=list(callbacks),
    )
    return module, trainer


def assert_same_params(a, b):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def listing(root):
    directory = root / "checkpoints"
    return (
        sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
        if directory.exists()
        else []
    )


def test_each_checkpoint_is_validated_with_a_manifest_of_checksums(tmp_path):
    run(tmp_path, 6, [ModelCheckpoint(every_n_steps=2, save_top_k=-1)])
    assert listing(tmp_path) == ["step-00000002", "step-00000004", "step-00000006"]
    for name in listing(tmp_path):
        ckpt = tmp_path / "checkpoints" / name
        meta = json.loads((ckpt / "meta.json").read_text())
        assert meta["pending_validation"] is True
        assert sorted(meta["manifest"]) == ["model.safetensors", "optimizer.pt", "state.pt"]
        entry = meta["manifest"]["model.safetensors"]  # taken while writing: equal to a fresh read-back
        assert entry == hash_file(ckpt / "model.safetensors") and len(entry["xxh3_128"][0]) == 32
        report = json.loads((ckpt / "validated.json").read_text())
        assert report["step"] == int(name.split("-")[1]) and report["atol"] == 0.0


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_last_skips_a_damaged_newest_checkpoint_and_resumes_exactly_from_the_one_before(
    tmp_path, caplog, damage
):
    straight, _ = run(tmp_path / "straight", 8)
    root = tmp_path / "run"
    run(root, 6, [ModelCheckpoint(every_n_steps=2, save_top_k=2)])
    assert listing(root) == ["step-00000004", "step-00000006"]
    victim = root / "checkpoints" / "step-00000006" / "model.safetensors"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x10
    else:
        del data[len(data) // 2 :]
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO, logger="trainer"):
        resumed, _ = run(root, 8, [ModelCheckpoint(every_n_steps=2, save_top_k=2)], ckpt_path="last")
    why = (
        r"model.safetensors checksum mismatch at bytes 0-\d+ \(corrupted or altered\)"
        if damage == "flip"
        else r"model.safetensors has \d+ bytes, \d+ were written \(truncated or altered\)"
    )
    # one warning: what was skipped and why, then what it resumes from
    said = next(r.message for r in caplog.records if "ckpt_path='last': skipped" in r.message)
    assert re.fullmatch(
        rf"ckpt_path='last': skipped step-00000006: {why}\n"
        rf"resuming from {re.escape(str(root))}/checkpoints/step-00000004: step 4, saved \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d",
        said,
    ), said
    assert_same_params(resumed, straight)
    assert "discarded-step-00000006" in listing(root)  # kept for inspection, never picked by "last"


class BadSave(SingleDeviceStrategy):
    """Writes wrong weights into the checkpoint of one step: the checksums match the files, the loss
    does not match the live model's. Only reloading the checkpoint and its validation loss can tell."""

    def __init__(self, bad_step: int) -> None:
        super().__init__()
        self.bad_step = bad_step

    def save_checkpoint(self, path, module, optimizer, state):
        if state["loop"]["global_step"] != self.bad_step:
            return super().save_checkpoint(path, module, optimizer, state)
        weight = next(module.parameters())
        kept = weight.detach().clone()
        with torch.no_grad():
            weight.add_(0.5)
        try:
            super().save_checkpoint(path, module, optimizer, state)
        finally:
            with torch.no_grad():
                weight.copy_(kept)


class Listing(Callback):
    def __init__(self, root):
        self.root, self.seen = root, {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen[trainer.global_step] = listing(self.root)


def test_a_checkpoint_that_reloads_differently_fails_validation_and_the_good_one_is_kept(tmp_path, caplog):
    spy = Listing(tmp_path)
    with caplog.at_level(logging.INFO, logger="trainer"):
        run(
            tmp_path,
            6,
            [ModelCheckpoint(every_n_steps=2, save_top_k=1), spy],
            strategy=BadSave(bad_step=4),
            val_loader=regression_loader(batch_size=8),
        )
    failed = [r.message for r in caplog.records if "failed validation" in r.message]
    assert len(failed) == 1 and "step-00000004" in failed[0] and "live" in failed[0]
    assert spy.seen[4] == ["bad-step-00000004", "step-00000002"]  # top-1, yet the good one stays
    assert listing(tmp_path) == ["bad-step-00000004", "step-00000006"]
    assert not (tmp_path / "checkpoints" / "bad-step-00000004" / "validated.json").exists()


def test_a_checkpoint_that_was_never_validated_is_not_resumed_from(tmp_path, caplog):
    straight, _ = run(tmp_path / "straight", 6)
    root = tmp_path / "run"
    run(root, 4, [ModelCheckpoint(every_n_steps=2, save_top_k=2)])
    (root / "checkpoints" / "step-00000004" / "validated.json").unlink()  # as if killed while validating
    with caplog.at_level(logging.INFO, logger="trainer"):
        resumed, _ = run(root, 6, [ModelCheckpoint(every_n_steps=2)], ckpt_path="last")
    assert any("skipped step-00000004: never validated" in r.message for r in caplog.records)
    assert any("resuming from" in r.message and "step-00000002" in r.message for r in caplog.records)
    assert_same_params(resumed, straight)


def test_validation_off_still_checks_the_checksums(tmp_path, caplog):
    run(tmp_path, 4, [ModelCheckpoint(every_n_steps=2, validate=False)])
    ckpt = tmp_path / "checkpoints" / "step-00000004"
    assert not (ckpt / "validated.json").exists()
    (ckpt / "state.pt").write_bytes(b"garbage")
    with caplog.at_level(logging.INFO, logger="trainer"):
        run(tmp_path, 5, [ModelCheckpoint(validate=False)], ckpt_path="last")
    assert any("resuming from" in r.message and "step-00000002" in r.message for r in caplog.records)


def test_time_based_checkpoints(tmp_path):
    run(tmp_path, 3, [ModelCheckpoint(every_n_minutes=1e-9, save_top_k=-1)])
    assert listing(tmp_path) == ["step-00000001", "step-00000002", "step-00000003"]


def test_time_based_checkpoints_wait_for_the_interval(tmp_path, monkeypatch):
    clock = FakeClock()
    fake_time(monkeypatch, "callbacks.checkpoint", clock, "monotonic")

    class TwentyFiveSecondSteps(
        Callback
    ):  # listed first: the step's time has passed when the save is decided
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            clock.advance(25.0)

    every_minute = ModelCheckpoint(every_n_minutes=1, save_top_k=-1, save_last=False)
    run(tmp_path, 7, [TwentyFiveSecondSteps(), every_minute])
    # 75 s after the start at step 3, 75 s after that save at step 6; never at 25 or 50 s
    assert listing(tmp_path) == ["step-00000003", "step-00000006"]


def test_the_held_out_batch_is_the_first_validation_batch_or_validate_batch(tmp_path):
    class Seen(Regression):
        def __init__(self):
            super().__init__()
            self.validation_batches = []

        def validation_step(self, batch, batch_idx):
            self.validation_batches.append(batch[0])
            return super().validation_step(batch, batch_idx)

    val_loader = regression_loader(batch_size=8)
    first = next(iter(val_loader))[0]
    module = Seen()
    Trainer(max_steps=2, default_root_dir=tmp_path / "a", callbacks=[ModelCheckpoint()], **quiet()).fit(
        module, regression_loader(), val_loader
    )
    # the sanity check (2 batches), the end-of-fit validation loop (32), then the final save's live and
    # reloaded losses
    assert len(module.validation_batches) == 36
    assert all(torch.equal(x, first) for x in module.validation_batches[34:])

    given = (torch.ones(3, 8), torch.zeros(3, 1))
    module = Seen()
    cb = ModelCheckpoint(validate_batch=given)
    Trainer(max_steps=2, default_root_dir=tmp_path / "b", callbacks=[cb], **quiet()).fit(
        module, regression_loader()
    )
    assert len(module.validation_batches) == 2 and all(
        torch.equal(x, given[0]) for x in module.validation_batches
    )
    report = json.loads((tmp_path / "b" / "checkpoints" / "step-00000002" / "validated.json").read_text())
    assert report["checked"] == ["checksums", "reload", "loss"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every_n_minutes": 0}, "every_n_minutes=0 is invalid; allowed: a number > 0 or None"),
        ({"validate_atol": -1}, "validate_atol=-1 is invalid; allowed: a number >= 0"),
        ({"save_top_k": -2}, "save_top_k=-2 is invalid"),  # 0 is Lightning's "keep none"
    ],
)
def test_bad_model_checkpoint_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelCheckpoint(**kwargs)


class RottingDisk(SingleDeviceStrategy):
    """A disk that silently changes a byte of optimizer.pt of one checkpoint right after it was written:
    the manifest holds the checksums of what was written. Reloading the weights alone cannot tell."""

    def __init__(self, bad_step: int) -> None:
        super().__init__()
        self.bad_step = bad_step

    def save_checkpoint(self, path, module, optimizer, state):
        super().save_checkpoint(path, module, optimizer, state)
        if state["loop"]["global_step"] == self.bad_step:
            victim = path / "optimizer.pt"
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0x10
            victim.write_bytes(bytes(data))


def test_a_file_damaged_right_after_the_save_fails_validation_by_its_checksum(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="trainer"):
        run(
            tmp_path,
            4,
            [ModelCheckpoint(every_n_steps=2, save_top_k=-1)],
            strategy=RottingDisk(bad_step=4),
            val_loader=regression_loader(batch_size=8),
        )
    size = (tmp_path / "checkpoints" / "bad-step-00000004" / "optimizer.pt").stat().st_size
    assert [r.message for r in caplog.records if "failed validation" in r.message] == [
        f"checkpoint step-00000004 failed validation (optimizer.pt checksum mismatch at bytes 0-{size} "
        "(corrupted or altered)); moved to bad-step-00000004, the older good checkpoints are kept"
    ]
    assert listing(tmp_path) == ["bad-step-00000004", "step-00000002"]
    assert not (tmp_path / "checkpoints" / "bad-step-00000004" / "validated.json").exists()


class BackgroundWrites(SingleDeviceStrategy):
    """Says each checkpoint is still being written until the next save or the end of the fit waits for it,
    as an async-saving strategy does: ModelCheckpoint validates it only then."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = False

    @property
    def checkpoint_in_progress(self) -> bool:
        return self.writing

    def save_checkpoint(self, path, module, optimizer, state):
        super().save_checkpoint(path, module, optimizer, state)
        self.writing = True

    def finish_checkpoint(self) -> None:
        self.writing = False


class OwnSaveThenKilled(Callback):
    """At `step`: the user's own `trainer.save_checkpoint(path)`, then the process is killed."""

    def __init__(self, step, path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            raise KeyboardInterrupt("killed")


def test_a_checkpoint_a_killed_run_left_unvalidated_is_validated_by_checksums_and_reload_and_kept(tmp_path):
    root, own = tmp_path / "run", tmp_path / "own-save"
    with pytest.raises(KeyboardInterrupt):
        run(
            root,
            4,
            [ModelCheckpoint(every_n_steps=2), OwnSaveThenKilled(3, own)],
            strategy=BackgroundWrites(),
            val_loader=regression_loader(batch_size=8),
        )
    step2 = root / "checkpoints" / "step-00000002"
    assert listing(root) == ["step-00000002"] and not (step2 / "validated.json").exists()
    # resumed with another held-out batch: run 1's live loss on its own batch is no reference for it
    other_batch = (torch.ones(4, 8), torch.zeros(4, 1))
    run(root, 4, [ModelCheckpoint(every_n_steps=2, validate_batch=other_batch)], ckpt_path=own)
    assert listing(root) == ["step-00000002", "step-00000004"]
    report = json.loads((step2 / "validated.json").read_text())
    assert report["checked"] == ["checksums", "reload"] and report["loss"] is None


class SlowValidation(Regression):
    """Each validation forward takes 3 s of a fake clock (a large model's reload-and-compare); each
    training step 10 s."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def training_step(self, batch, batch_idx):
        self.clock.advance(10.0)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.clock.advance(3.0)
        return super().validation_step(batch, batch_idx)


@pytest.mark.parametrize("budget", [0.1, None])
def test_validation_stays_within_its_time_budget_and_reports_its_cost(tmp_path, monkeypatch, caplog, budget):
    clock = FakeClock()
    fake_time(monkeypatch, "callbacks.checkpoint", clock, "monotonic")
    fake_time(monkeypatch, "callbacks.checkpoint_validation", clock, "monotonic")
    saver = ModelCheckpoint(every_n_steps=2, save_top_k=-1, validate_budget=budget)
    with caplog.at_level(logging.INFO, logger="trainer"):
        fit(SlowValidation(clock), regression_loader(), tmp_path, 12, val_loader=regression_loader(8),
            callbacks=[saver], num_sanity_val_steps=0)  # fmt: skip
    steps = [2, 4, 6, 8, 10, 12]
    validated = [s for s in steps if (tmp_path / "checkpoints" / f"step-{s:08d}" / "validated.json").exists()]
    if budget is None:
        assert validated == steps
        return
    # the first always; later ones once 1 s + 10% of the fit's time covers what validation has cost
    # (two forwards: 6 s each) plus the next one: at step 12 (126 s in, 12 s <= 13.6 s), not before
    assert validated == [2, 12]
    report = json.loads((tmp_path / "checkpoints" / "step-00000012" / "validated.json").read_text())
    assert report["seconds"] == 6.0 and report["interval_s"] == 20.0
    lines = [r.message for r in caplog.records if r.message.startswith("checkpoint step-")]
    assert (
        "validated (checksums, reload, loss) in 6.00 s (30.0% of the 20.0 s since the previous checkpoint)"
        in lines[0]
    )
    assert "reload check skipped: validation has cost 6.00 s of this fit and the last one 6.00 s" in lines[1]
    # a checkpoint not reloaded is still good: its hashes were taken as it was written
    assert ckpt.find_last_good(tmp_path / "checkpoints", before_step=12)[0].name == "step-00000010"


def test_resume_says_which_checkpoints_it_skipped_and_that_it_starts_fresh_when_none_is_good(
    tmp_path, caplog
):
    run(tmp_path, 4, [ModelCheckpoint(every_n_steps=2, save_top_k=2)])
    for step in (2, 4):
        (tmp_path / "checkpoints" / f"step-{step:08d}" / "optimizer.pt").write_bytes(b"not an optimizer")
    with caplog.at_level(logging.INFO, logger="trainer"):
        _, trainer = run(tmp_path, 2, [ModelCheckpoint(every_n_steps=2)], ckpt_path="last")
    said = next(r.message for r in caplog.records if "ckpt_path='last': skipped" in r.message)
    size = r"\d+ bytes, \d+ were written \(truncated or altered\)"
    assert re.fullmatch(
        rf"ckpt_path='last': skipped step-00000004: optimizer.pt has {size}\n"
        rf"ckpt_path='last': skipped step-00000002: optimizer.pt has {size}\n"
        rf"ckpt_path='last': no checkpoint in {re.escape(str(tmp_path / 'checkpoints'))} is good, starting from scratch",
        said,
    ), said
    assert trainer.global_step == 2 and trainer.state.restarts == 0  # trained from step 0


def test_validate_from_last_says_it_loads_the_checkpoint_not_that_it_resumes(tmp_path, caplog):
    run(tmp_path, 4, [ModelCheckpoint(every_n_steps=2)])
    trainer = Trainer(default_root_dir=tmp_path, **quiet())
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer.validate(Regression(), regression_loader(), ckpt_path="last")
    lines = [r.message for r in caplog.records if "step-00000004: step 4, saved" in r.message]
    assert len(lines) == 1 and lines[0].startswith("loading from "), lines
