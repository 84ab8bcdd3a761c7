"""Lightning's documented examples, written as a Lightning user writes them, run on PyTorch Lightning or
on this project with the import as the only difference:

    python lightning_parity.py {lightning|trainer} OUT FORM[,FORM...] --devices N

A classifier with `save_hyperparameters`, `self.log(on_step, on_epoch, sync_dist, batch_size,
reduce_fx)`, `log_dict`, torchmetrics metrics (a `Metric` called per batch, one only updated, a
`MetricCollection` through `log_dict`), epoch-end hooks, a datamodule with `prepare_data` and
`save_hyperparameters`, `configure_optimizers` in the return form FORM ("onecycle": OneCycleLR over
`trainer.estimated_stepping_batches`; "half_epoch": the plain form validating every half epoch,
`val_check_interval=0.5`), then fit, validate, test and predict through Lightning's keywords
(a DataModule passed positionally too), for each FORM in turn. DEVICES > 1 runs DDP on
that many CPU processes. Each rank writes OUT/FORM/rank<R>.json: every hook call (module and a callback) in order, the learning rate
and loss of every optimizer step, the logged metric series, `callback_metrics`, `logged_metrics`, the
trainer's attributes as the module reads them, the results of validate/test/predict and the final weights."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from trainer.core.launch import destroy_process_group

_parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_parser.add_argument("framework", choices=["lightning", "trainer"])
_parser.add_argument("out", type=Path)
_parser.add_argument("forms")  # FORM[,FORM...]
_parser.add_argument("--devices", type=int, required=True)
_args = _parser.parse_args()
FRAMEWORK, OUT, DEVICES, FORMS = _args.framework, _args.out, _args.devices, _args.forms.split(",")
if FRAMEWORK == "lightning":
    from pytorch_lightning import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
else:
    from callbacks import Callback
    from trainer import DataModule as LightningDataModule
    from trainer import Trainer, seed_everything
    from trainer import TrainModule as LightningModule

from hook_recording import recording  # noqa: E402

CALLS: list[str] = []
MODULE_HOOKS = [
    "prepare_data", "setup", "configure_model", "on_fit_start", "on_train_start", "on_train_epoch_start",
    "on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_train_batch_end", "on_train_epoch_end", "on_train_end", "on_fit_end",
    "on_validation_model_eval", "on_validation_model_train", "on_validation_model_zero_grad", "on_validation_start",
    "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
    "on_validation_epoch_end", "on_validation_end", "on_test_model_eval", "on_test_start",
    "on_test_epoch_start", "on_test_batch_start", "on_test_batch_end", "on_test_epoch_end", "on_test_end",
    "on_predict_model_eval", "on_predict_start", "on_predict_epoch_start", "on_predict_batch_start",
    "on_predict_batch_end", "on_predict_epoch_end", "on_predict_end", "teardown",
]  # fmt: skip
CALLBACK_HOOKS = [
    "setup", "on_fit_start", "on_sanity_check_start", "on_sanity_check_end", "on_train_start",
    "on_train_epoch_start", "on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_train_batch_end", "on_train_epoch_end", "on_train_end", "on_fit_end",
    "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
    "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end", "on_test_start",
    "on_test_batch_end", "on_test_end", "on_predict_start", "on_predict_batch_end", "on_predict_end",
    "teardown",
]  # fmt: skip


@recording(MODULE_HOOKS, "", CALLS)
class LitClassifier(LightningModule):
    def __init__(self, hidden_dim: int = 32, learning_rate: float = 0.2, form: str = "plain"):
        super().__init__()
        self.save_hyperparameters()
        self.layer_1 = nn.Linear(8, self.hparams.hidden_dim)
        self.layer_2 = nn.Linear(self.hparams.hidden_dim, 3)
        self.train_accuracy = MulticlassAccuracy(num_classes=3)
        self.val_accuracy = MulticlassAccuracy(num_classes=3)
        self.test_accuracy = MulticlassAccuracy(num_classes=3)
        self.val_metrics = MetricCollection(
            {
                "acc": MulticlassAccuracy(num_classes=3, average="micro"),
                "f1": MulticlassF1Score(num_classes=3),
            },
            prefix="val_tm_",
        )
        self.steps: list[dict] = []
        self.attrs: dict = {}

    def forward(self, x):
        return self.layer_2(torch.relu(self.layer_1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("train_acc", acc, on_epoch=True, batch_size=len(y))
        self.log("batch_max", x.abs().max(), on_step=False, on_epoch=True, reduce_fx="max")
        self.train_accuracy(logits, y)
        self.log("train_accuracy", self.train_accuracy, on_step=True, on_epoch=True)
        lr = self.optimizers().param_groups[0]["lr"]
        self.steps.append(
            {"epoch": self.current_epoch, "step": self.global_step, "lr": lr, "loss": loss.item()}
        )
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log_dict({"val_acc": (logits.argmax(-1) == y).float().mean()}, sync_dist=True)
        self.val_accuracy.update(logits, y)
        self.log("val_accuracy", self.val_accuracy, prog_bar=True)
        self.val_metrics.update(logits, y)
        self.log_dict(self.val_metrics)

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("test_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.test_accuracy(logits, y)
        self.log_dict({"test_accuracy": self.test_accuracy})

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self(x).argmax(-1)

    def on_train_epoch_end(self):
        self.log("epochs_done", float(self.current_epoch + 1), sync_dist=True)

    def on_train_start(self):
        trainer = self.trainer
        self.attrs.update(
            optimizers=len(trainer.optimizers),
            intervals=[config.interval for config in trainer.lr_scheduler_configs],
            world_size=trainer.world_size,
            num_devices=trainer.num_devices,
            precision=trainer.precision,
            max_epochs=trainer.max_epochs,
            num_training_batches=trainer.num_training_batches,
            checkpoint_callbacks=len(trainer.checkpoint_callbacks),
        )

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)
        sched = torch.optim.lr_scheduler
        form = self.hparams.form
        self.attrs["estimated_stepping_batches"] = self.trainer.estimated_stepping_batches
        if form in ("plain", "half_epoch"):
            return opt
        if form == "list":
            return [opt]
        if form == "lists":
            return [opt], [sched.StepLR(opt, step_size=1, gamma=0.5)]
        if form == "dict":
            return {"optimizer": opt, "lr_scheduler": sched.ExponentialLR(opt, gamma=0.7)}
        if form == "step_interval":
            config = {
                "scheduler": sched.StepLR(opt, step_size=2, gamma=0.8),
                "interval": "step",
                "frequency": 3,
            }
            return {"optimizer": opt, "lr_scheduler": config}
        if form == "plateau":
            plateau = sched.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, threshold=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}
        if form == "onecycle":
            total = self.trainer.estimated_stepping_batches  # OneCycleLR refuses to step beyond it
            onecycle = sched.OneCycleLR(opt, max_lr=0.5, total_steps=total)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": onecycle, "interval": "step"}}
        raise ValueError(form)


class ToyData(LightningDataModule):
    """Three Gaussian blobs; `prepare_data` writes them to a file that `setup` reads, as a download would."""

    def __init__(self, root: Path, batch_size: int = 8, shuffle: bool = False):
        super().__init__()
        self.save_hyperparameters("batch_size", "shuffle")
        self.root = root

    def prepare_data(self):
        CALLS.append("dm.prepare_data")
        g = torch.Generator().manual_seed(1234)
        y = torch.arange(160) % 3
        x = torch.randn(160, 8, generator=g) + 2.0 * nn.functional.one_hot(y, 8).float()
        torch.save({"x": x, "y": y}, self.root / "toy.pt")

    def setup(self, stage):
        CALLS.append(f"dm.setup:{getattr(stage, 'value', stage)}")  # Lightning passes a str enum
        data = torch.load(self.root / "toy.pt")
        self.train = TensorDataset(data["x"][:96], data["y"][:96])
        self.val = TensorDataset(data["x"][96:128], data["y"][96:128])
        self.test = TensorDataset(data["x"][128:], data["y"][128:])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=self.hparams.shuffle)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=self.hparams.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.test, batch_size=self.hparams.batch_size)


@recording(CALLBACK_HOOKS, "cb.", CALLS)
class Recorder(Callback):
    pass


def plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def run(form: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    CALLS.clear()
    seed_everything(0)
    model = LitClassifier(form=form)
    # Lightning shuffles a distributed train loader whatever it says, so DDP runs shuffle here too. One
    # process keeps shuffle off: Lightning's validation loops draw from the global RNG that a shuffled
    # loader reads, so validating changes its training order (here validation never does; README)
    data = ToyData(out, shuffle=DEVICES > 1)
    trainer = Trainer(
        accelerator="cpu", devices=DEVICES, strategy="ddp" if DEVICES > 1 else "auto", max_epochs=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1, default_root_dir=out, callbacks=[Recorder()],
        **({"val_check_interval": 0.5} if form == "half_epoch" else {}),
    )  # fmt: skip
    trainer.fit(model, data)  # a DataModule where the loaders go: Lightning takes it as the datamodule
    fit_calls = list(CALLS)
    CALLS.clear()
    record = {
        "fit_calls": fit_calls,
        "steps": model.steps,
        "hparams": dict(model.hparams),
        "datamodule_hparams": dict(data.hparams),
        "attrs": model.attrs,
        "callback_metrics": plain(dict(trainer.callback_metrics)),
        "logged_metrics": plain(dict(trainer.logged_metrics)),
        "weights": {k: v.flatten().tolist() for k, v in model.state_dict().items()},
    }
    record["validate"] = plain(trainer.validate(model, data))
    record["validate_calls"], CALLS[:] = list(CALLS), []
    record["test"] = plain(trainer.test(model=model, datamodule=data))
    record["test_calls"], CALLS[:] = list(CALLS), []
    record["predict"] = plain(trainer.predict(model=model, dataloaders=data))
    record["predict_calls"] = list(CALLS)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    torch.set_num_threads(1)
    for form in FORMS:
        run(form, OUT / form)


if __name__ == "__main__":
    main()
    # Lightning leaves its gloo group to the interpreter's finalisation, where its threads can abort the
    # process after the run ("terminate called without an active exception", seen in CI): shut it down here
    destroy_process_group()
