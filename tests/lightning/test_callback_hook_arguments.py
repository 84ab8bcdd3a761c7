"""Every hook of Lightning 2.6's Callback gets the same arguments here as under Lightning (issue 52): one
recording callback, on either base class, through a fit with two validation loaders and a ModelCheckpoint,
validate (two loaders), test (two loaders), predict, a fit resumed from a checkpoint and a fit whose
training_step raises; the two lists of calls are equal, up to the differences README lists."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import callbacks
import trainer

FRAMEWORKS = ("lightning", "trainer")
STAGES = ("fit", "validate", "test", "predict")


def tensors(value: Any) -> Any:
    """A plain summary of a batch, outputs or loss: each tensor's float sum (rounded), containers kept."""
    if isinstance(value, torch.Tensor):
        return round(float(value.detach().double().sum()), 4)
    if isinstance(value, dict):
        return {key: tensors(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [tensors(v) for v in value]
    return type(value).__name__


def make(framework: str):
    """The recorder and a classifier written as Lightning's docs write them, on Lightning's or this project's
    base classes."""
    Callback = pl.Callback if framework == "lightning" else callbacks.Callback
    Module = pl.LightningModule if framework == "lightning" else trainer.TrainModule

    class Recorder(Callback):
        def __init__(self):
            self.calls = []

        def record(self, hook, *arguments):
            self.calls.append((hook, *arguments))

        def checkpoint(self, checkpoint):
            own = checkpoint.get("callbacks", {}).get(self.state_key)
            return checkpoint.get("global_step"), checkpoint.get("epoch"), own

        def setup(self, trainer, pl_module, stage):
            self.record("setup", [s for s in STAGES if stage == s])  # Lightning's is a str Enum

        def teardown(self, trainer, pl_module, stage):
            self.record("teardown", [s for s in STAGES if stage == s])

        def on_fit_start(self, trainer, pl_module):
            self.record("on_fit_start")

        def on_fit_end(self, trainer, pl_module):
            self.record("on_fit_end")

        def on_sanity_check_start(self, trainer, pl_module):
            self.record("on_sanity_check_start")

        def on_sanity_check_end(self, trainer, pl_module):
            self.record("on_sanity_check_end")

        def on_train_start(self, trainer, pl_module):
            self.record("on_train_start")

        def on_train_end(self, trainer, pl_module):
            self.record("on_train_end")

        def on_train_epoch_start(self, trainer, pl_module):
            self.record("on_train_epoch_start")

        def on_train_epoch_end(self, trainer, pl_module):
            self.record("on_train_epoch_end")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.record("on_train_batch_start", tensors(batch), batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.record("on_train_batch_end", tensors(outputs), tensors(batch), batch_idx)

        def on_before_backward(self, trainer, pl_module, loss):
            self.record("on_before_backward", tensors(loss))

        def on_after_backward(self, trainer, pl_module):
            self.record("on_after_backward")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.record("on_before_optimizer_step", type(optimizer).__name__)

        def on_before_zero_grad(self, trainer, pl_module, optimizer):
            self.record("on_before_zero_grad", type(optimizer).__name__)

        def on_validation_start(self, trainer, pl_module):
            self.record("on_validation_start")

        def on_validation_end(self, trainer, pl_module):
            # what the two loaders' `self.log("val_loss")` became (Lightning's `/dataloader_idx_<i>` names);
            # not in the sanity check, whose values Lightning shows with one loader only, and neither keeps
            names = [] if trainer.sanity_checking else trainer.callback_metrics
            self.record("on_validation_end", sorted(k for k in names if k.startswith("val_loss")))

        def on_validation_epoch_start(self, trainer, pl_module):
            self.record("on_validation_epoch_start")

        def on_validation_epoch_end(self, trainer, pl_module):
            self.record("on_validation_epoch_end")

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            self.record("on_validation_batch_start", tensors(batch), batch_idx, dataloader_idx)

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            self.record(
                "on_validation_batch_end", tensors(outputs), tensors(batch), batch_idx, dataloader_idx
            )

        def on_test_start(self, trainer, pl_module):
            self.record("on_test_start")

        def on_test_end(self, trainer, pl_module):
            self.record(
                "on_test_end", sorted(k for k in trainer.callback_metrics if k.startswith("test_loss"))
            )

        def on_test_epoch_start(self, trainer, pl_module):
            self.record("on_test_epoch_start")

        def on_test_epoch_end(self, trainer, pl_module):
            self.record("on_test_epoch_end")

        def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            self.record("on_test_batch_start", tensors(batch), batch_idx, dataloader_idx)

        def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            self.record("on_test_batch_end", tensors(outputs), tensors(batch), batch_idx, dataloader_idx)

        def on_predict_start(self, trainer, pl_module):
            self.record("on_predict_start")

        def on_predict_end(self, trainer, pl_module):
            self.record("on_predict_end")

        def on_predict_epoch_start(self, trainer, pl_module):
            self.record("on_predict_epoch_start")

        def on_predict_epoch_end(self, trainer, pl_module):
            self.record("on_predict_epoch_end")

        def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            self.record("on_predict_batch_start", tensors(batch), batch_idx, dataloader_idx)

        def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            self.record("on_predict_batch_end", tensors(outputs), tensors(batch), batch_idx, dataloader_idx)

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            self.record("on_save_checkpoint", *self.checkpoint(checkpoint))

        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            self.record("on_load_checkpoint", *self.checkpoint(checkpoint))

        def on_exception(self, trainer, pl_module, exception):
            self.record("on_exception", type(exception).__name__, str(exception))

        def state_dict(self):
            self.record("state_dict")
            return {"calls": len(self.calls)}

        def load_state_dict(self, state_dict):
            self.record("load_state_dict", dict(state_dict))

    class Classifier(Module):
        def __init__(self, fail_at: int = -1):
            super().__init__()
            self.fail_at = fail_at
            self.net = nn.Linear(4, 3)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            if batch_idx == self.fail_at:
                raise RuntimeError(f"training_step failed at batch {batch_idx}")
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.log("val_loss", loss)
            return loss

        def test_step(self, batch, batch_idx, dataloader_idx=0):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.log("test_loss", loss)
            return {"loss": loss, "n": len(y)}

        def predict_step(self, batch, batch_idx):
            x, _ = batch
            return self(x).argmax(dim=1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Recorder, Classifier


def loader(n: int, batch_size: int, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    data = TensorDataset(
        torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)
    )
    return DataLoader(data, batch_size=batch_size)


def run(framework: str, tmp_path) -> list[tuple]:
    """Each stage with a recorder of its own; their calls one stage after the other."""
    Recorder, Classifier = make(framework)
    Trainer = pl.Trainer if framework == "lightning" else trainer.Trainer
    root = tmp_path / framework
    flags = dict(accelerator="cpu", default_root_dir=root, logger=False, enable_progress_bar=False)
    flags.update(enable_checkpointing=False, enable_model_summary=False)
    train, vals = loader(24, 8, 1), [loader(16, 8, 2), loader(12, 6, 3)]
    tests = [loader(10, 4, 4), loader(6, 3, 5)]
    calls: list[tuple] = []

    def stage(name: str, max_epochs: int = 2, checkpoint: Any = None, **module: Any) -> tuple[Any, Any, Any]:
        """A fresh recorder, its Trainer (with `checkpoint`, if given) and a module seeded alike."""
        recorder = Recorder()
        calls.append(("---", name))
        torch.manual_seed(0)
        more = [] if checkpoint is None else [checkpoint]
        kwargs = {**flags, "enable_checkpointing": checkpoint is not None}
        return (
            recorder,
            Trainer(callbacks=[recorder, *more], max_epochs=max_epochs, **kwargs),
            Classifier(**module),
        )

    # every validation saves (top k = all), ranked by the first loader's loss: on_save_checkpoint inside a fit
    ModelCheckpoint = pl.callbacks.ModelCheckpoint if framework == "lightning" else callbacks.ModelCheckpoint
    best = ModelCheckpoint(root / "best", monitor="val_loss/dataloader_idx_0", save_top_k=-1, save_last=False)
    recorder, fit, model = stage("fit", 2, best)
    fit.fit(model, train, vals)
    fit.save_checkpoint(root / "fitted.ckpt")
    calls += recorder.calls
    for name in ("validate", "test", "predict"):
        recorder, evaluation, _ = stage(name)
        getattr(evaluation, name)(model, vals if name == "validate" else tests if name == "test" else vals[1])
        calls += recorder.calls
    recorder, resumed, fresh = stage("resumed fit", max_epochs=3)
    resumed.fit(fresh, train, vals[0], ckpt_path=root / "fitted.ckpt")
    calls += recorder.calls
    recorder, failing, failing_model = stage("failing fit", fail_at=1)
    with pytest.raises(RuntimeError, match="training_step failed at batch 1"):
        failing.fit(failing_model, train, vals[0])
    calls += recorder.calls
    return calls


def as_here(calls: list[tuple]) -> list[tuple]:
    """Lightning's calls with the differences README.md lists under "Coming from Lightning", "What differs on
    purpose", applied: `on_before_zero_grad` fires after the optimizer step (its own bullet); from the bullet on
    callback hooks, `on_train_batch_end`'s outputs also hold `skipped`, `teardown` also runs after
    `on_exception`, and `on_load_checkpoint` fires after the callbacks' `load_state_dict`."""
    out: list[tuple] = []
    held: list[tuple] = []
    for call in calls:
        if call[0] == "on_before_zero_grad":
            held.append(call)
            continue
        if call[0] == "on_train_batch_end":
            call = (call[0], {**call[1], "skipped": "bool"}, *call[2:])
        if call[0] == "load_state_dict" and out[-1][0] == "on_load_checkpoint":
            out.insert(len(out) - 1, call)
            continue
        out.append(call)
        if call[0] == "on_before_optimizer_step":
            out += held
            held = []
        if call[0] == "on_exception":
            out.append(("teardown", ["fit"]))
    assert not held
    return out


def test_the_recorder_overrides_every_hook_of_lightnings_callback():
    hooks = {name for name in vars(pl.Callback) if not name.startswith("_") and name != "state_key"}
    for framework in FRAMEWORKS:
        Recorder, _ = make(framework)
        assert hooks - set(vars(Recorder)) == set()


def test_every_hook_gets_lightnings_arguments(tmp_path):
    ours, theirs = run("trainer", tmp_path), run("lightning", tmp_path)
    assert ours == as_here(theirs)


def test_predict_refuses_several_loaders_in_one_line(tmp_path):
    _, Classifier = make("trainer")
    ours = trainer.Trainer(
        accelerator="cpu", default_root_dir=tmp_path, logger=False, enable_progress_bar=False
    )
    with pytest.raises(ValueError, match="predict got 2 dataloaders; allowed: one"):
        ours.predict(Classifier(), [loader(8, 4, 1), loader(8, 4, 2)])
