"""A callback written for Lightning runs here unchanged (issue 52): every hook of Lightning 2.6's Callback with
its signature, and a callback copied from Lightning's docs seeing the same arguments under both Trainers."""

from __future__ import annotations

import inspect

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import callbacks
import trainer

LIGHTNING_ONLY = {"on_exception"}  # compared below like the rest; named to show it is Lightning's too


def hooks(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(getattr(cls, name))
        for name in dir(cls)
        if (name.startswith("on_") or name in ("setup", "teardown", "state_dict", "load_state_dict"))
        and callable(getattr(cls, name))
    }


def shape(signature: inspect.Signature) -> list[tuple[str, object]]:
    """The parameters as (name, default): the same names, so a keyword call (`pl_module=...`) reaches both."""
    return [(p.name, p.default) for p in signature.parameters.values()]


def test_every_lightning_callback_hook_exists_with_its_signature():
    theirs, ours = hooks(pl.Callback), hooks(callbacks.Callback)
    assert set(theirs) <= set(ours), sorted(set(theirs) - set(ours))
    assert {n: shape(s) for n, s in theirs.items()} == {n: shape(ours[n]) for n in theirs}


def make(framework: str):
    """Lightning's docs' callback and a small classifier, on Lightning's or this project's base classes."""
    Callback = pl.Callback if framework == "lightning" else callbacks.Callback
    Module = pl.LightningModule if framework == "lightning" else trainer.TrainModule

    class Recorder(Callback):
        def __init__(self):
            self.calls = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.calls.append(("train_batch_start", batch_idx, float(batch[0].sum())))

        def on_before_backward(self, trainer, pl_module, loss):
            self.calls.append(("before_backward", round(float(loss), 6)))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.calls.append(
                ("train_batch_end", batch_idx, float(batch[0].sum()), round(float(outputs["loss"]), 6))
            )

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            if not trainer.sanity_checking:
                self.calls.append(("validation_batch_end", batch_idx, dataloader_idx, float(batch[0].sum())))

    class Classifier(Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Recorder(), Classifier


def run(framework: str, tmp_path) -> list[tuple]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(24, 4), torch.randint(0, 3, (24,)))
    recorder, Classifier = make(framework)
    kwargs = dict(max_epochs=2, limit_val_batches=2, default_root_dir=tmp_path / framework, logger=False)
    kwargs.update(enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    Trainer = pl.Trainer if framework == "lightning" else trainer.Trainer
    Trainer(accelerator="cpu", callbacks=[recorder], **kwargs).fit(
        Classifier(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8)
    )
    return recorder.calls


def test_a_callback_from_lightning_s_docs_sees_the_same_arguments(tmp_path):
    assert run("trainer", tmp_path) == run("lightning", tmp_path)
