"""Checkpoint validation has no side effects on the user's module, says what it checks, fails non-finite
models, and a fresh run warns when its checkpoint folder holds an earlier run's checkpoints."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import fit, regression_loader

from callbacks import Callback, ModelCheckpoint
from callbacks.checkpoint import ModelNotFiniteError
from trainer import TrainModule


class Counting(TrainModule):
    """A user's module: the steps call `self(x)` and log; training_step counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.training_calls = 0
        self.validation_batch_sizes: list[int] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.training_calls += 1
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("kind", 0.0)
        self.log("train_mse", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.validation_batch_sizes.append(x.shape[0])
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("kind", 1.0)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class NoValidationStep(Counting):
    validation_step = TrainModule.validation_step


class LogsOnly(Counting):
    """A validation_step that logs its loss and returns nothing, as many Lightning modules do."""

    def validation_step(self, batch, batch_idx):
        self.log("val_mse", super().validation_step(batch, batch_idx))


class NoBatches(torch.utils.data.IterableDataset):
    """A validation set that yields nothing (its loader has no len(), so only reading it tells)."""

    def __iter__(self):
        return iter(())


class PoisonAfter(Callback):
    """Fills the first weight with NaN once `step` optimizer steps are done (listed before the checkpoint
    callback, so that step's checkpoint already sees it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                module.net[0].weight.fill_(float("nan"))


def run(root, module, steps, callbacks, val_loader=None, ckpt_path=None):
    return fit(
        module,
        regression_loader(),
        root,
        steps,
        val_loader=val_loader,
        ckpt_path=ckpt_path,
        callbacks=callbacks,
    )


def rows(root):
    return [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]


def listing(root):
    return sorted(p.name for p in (root / "checkpoints").iterdir() if not p.name.startswith("."))


def messages(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_validation_runs_validation_step_on_a_validation_batch_and_never_training_step(tmp_path):
    module = Counting()
    run(
        tmp_path,
        module,
        6,
        # validate_budget=None: every save is validated however slow the machine (the budget's own tests time it)
        [ModelCheckpoint(every_n_steps=2, save_top_k=-1, validate_budget=None)],
        regression_loader(batch_size=8),
    )
    assert module.training_calls == 6  # one per optimizer step, none for 3 saves x (live + reloaded)
    assert set(module.validation_batch_sizes) == {8}  # only validation batches (training ones hold 16)
    # the sanity check's 2 batches, the end-of-fit val loop, then live + reloaded
    assert len(module.validation_batch_sizes) == 2 + 32 + 3 * 2
    for name in listing(tmp_path):
        report = json.loads((tmp_path / "checkpoints" / name / "validated.json").read_text())
        assert report["checked"] == ["checksums", "reload", "loss"] and report["loss"] > 0
    logged = rows(tmp_path)
    train = [r for r in logged if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:  # what validation_step logged during the saves did not leak into a training step
        assert r["kind"] == 0.0 and r["train_mse"] == pytest.approx(r["train/loss"])
    assert [r["kind"] for r in logged if "val/loss" in r] == [1.0]


@pytest.mark.parametrize(
    "module_cls, val_loader, why",
    [
        (Counting, None, "no validation data"),
        (NoValidationStep, None, "NoValidationStep defines no validation_step"),
        (
            LogsOnly,
            regression_loader(batch_size=8),
            "LogsOnly.validation_step returns no loss (return it to have each reloaded checkpoint's loss "
            "compared with the live model's)",
        ),
        (Counting, torch.utils.data.DataLoader(NoBatches(), batch_size=8), "the validation loader is empty"),
    ],
)
def test_without_a_validation_loss_checksums_and_a_reload_are_checked_and_said_once(
    tmp_path, caplog, module_cls, val_loader, why
):
    module = module_cls()
    with caplog.at_level(logging.INFO, logger="trainer"):
        run(tmp_path, module, 6, [ModelCheckpoint(every_n_steps=2, save_top_k=-1)], val_loader)
    assert module.training_calls == 6
    assert messages(caplog, "checkpoint validation") == [
        f"checkpoint validation: {why}; checking checksums and a reload only"
    ]
    assert listing(tmp_path) == ["step-00000002", "step-00000004", "step-00000006"]
    for name in listing(tmp_path):
        report = json.loads((tmp_path / "checkpoints" / name / "validated.json").read_text())
        assert report["checked"] == ["checksums", "reload"] and report["loss"] is None


@pytest.mark.parametrize(
    "val_loader, why",
    [(regression_loader(batch_size=8), "live loss nan"), (None, "net.0.weight has non-finite values")],
)
def test_a_model_that_is_not_finite_fails_its_checkpoint_and_the_older_good_one_is_kept(
    tmp_path, caplog, val_loader, why
):
    callbacks = [PoisonAfter(step=4), ModelCheckpoint(every_n_steps=2, save_top_k=1)]
    # the fit ends, non-zero for a script, naming since when and what is left (it used to end "fine")
    with caplog.at_level(logging.INFO, logger="trainer"), pytest.raises(ModelNotFiniteError) as err:
        run(tmp_path, Counting(), 6, callbacks, val_loader)
    assert str(err.value) == "the model is not finite since step 4; last good checkpoint: step-00000002"
    assert messages(caplog, "checkpoint step-00000004") == [
        f"checkpoint step-00000004 is bad: the model is not finite at step 4 ({why}); moved to bad-step-00000004, "
        "the older good checkpoints are kept"
    ]
    assert not messages(caplog, "reloaded")
    assert listing(tmp_path) == ["bad-step-00000004", "step-00000002"]
    assert (tmp_path / "checkpoints" / "step-00000002" / "validated.json").exists()


def test_a_fresh_run_in_a_folder_with_an_earlier_runs_checkpoints_writes_a_new_version_and_says_where(
    tmp_path, caplog
):
    with caplog.at_level(logging.INFO, logger="trainer"):
        run(tmp_path, Counting(), 4, [ModelCheckpoint(every_n_steps=2)])
    assert not messages(caplog, "earlier run")  # an empty folder: nothing to say
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        run(tmp_path, Counting(), 1, [ModelCheckpoint(every_n_steps=2)])
    warned = [r for r in caplog.records if "earlier run" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    folder = tmp_path / "checkpoints"
    assert warned[0].getMessage() == (
        f"{folder} holds an earlier run's checkpoints (kept untouched); this run writes to {folder / 'version_1'}"
    )
    assert listing(tmp_path) == ["step-00000002", "step-00000004", "version_1"]  # nothing deleted
    assert sorted(p.name for p in (folder / "version_1").iterdir()) == ["step-00000001"]
