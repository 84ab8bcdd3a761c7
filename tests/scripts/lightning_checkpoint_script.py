"""Lightning's checkpointing, written as its docs write it, on PyTorch Lightning or on this project with the
import as the only difference:

    python lightning_checkpoint_script.py {lightning|trainer} OUT [STRATEGY] --devices N

A LitAutoEncoder with `save_hyperparameters`, fitted with `ModelCheckpoint(monitor="val_loss", mode="min",
save_top_k=2, filename=...)`, then `test(ckpt_path="best")`, `LitAutoEncoder.load_from_checkpoint(best)`
and `predict` with it. DEVICES > 1 runs STRATEGY (default ddp) on that many CPU processes. Each rank writes
OUT/rank<R>.json: the validation losses, the checkpoint attributes (names without Lightning's `.ckpt`),
the test results, the loaded module's hparams and weights, its predictions and the final weights."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer.core.launch import destroy_process_group

_parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_parser.add_argument("framework", choices=["lightning", "trainer"])
_parser.add_argument("out", type=Path)
_parser.add_argument("strategy", nargs="?")
_parser.add_argument("--devices", type=int, required=True)
_args = _parser.parse_args()
FRAMEWORK, OUT, DEVICES = _args.framework, _args.out, _args.devices
STRATEGY = _args.strategy or ("ddp" if DEVICES > 1 else "auto")
if FRAMEWORK == "lightning":
    from pytorch_lightning import LightningModule, Trainer, seed_everything
    from pytorch_lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger
else:
    from callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
    from trainer import Trainer, seed_everything
    from trainer import TrainModule as LightningModule
    from trainer.loggers import CSVLogger


class LitAutoEncoder(LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 1.3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(12, hidden), nn.ReLU(), nn.Linear(hidden, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, 12))
        self.val_losses: list[float] = []

    def forward(self, x):
        return self.encoder(x)

    def _loss(self, batch):
        (x,) = batch
        return F.mse_loss(self.decoder(self.encoder(x)), x)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def on_validation_end(self):
        if not self.trainer.sanity_checking:
            self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.9)}


def loaders() -> tuple[DataLoader, DataLoader]:
    x = torch.randn(80, 12, generator=torch.Generator().manual_seed(1234))
    # Lightning shuffles a distributed train loader whatever it says: so do the runs on more processes
    train = DataLoader(TensorDataset(x[:48]), batch_size=8, shuffle=DEVICES > 1)
    return train, DataLoader(TensorDataset(x[48:]), batch_size=8)


def name(path: str) -> str:
    return Path(path).name.removesuffix(".ckpt") if path else ""


def weights(module: nn.Module) -> dict[str, list[float]]:
    """The full weights (a sharded DTensor gathered: every rank calls this)."""
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()}
    return {k: v.flatten().tolist() for k, v in full.items()}


def csv_columns(path: Path) -> dict[str, list[float]]:
    """The CSV logger's values of each column (empty cells left out; the LR monitor's names unified)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    columns: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if value != "":
                columns.setdefault("lr" if key.startswith("lr") else key, []).append(float(value))
    return columns


def main() -> None:
    torch.set_num_threads(1)
    seed_everything(0)
    train, val = loaders()
    model = LitAutoEncoder()
    checkpoint = ModelCheckpoint(
        dirpath=OUT / "checkpoints",
        filename="{epoch}-{val_loss:.4f}",
        monitor="val_loss",
        mode="min",
        save_top_k=2,
    )
    stopping = EarlyStopping(monitor="val_loss", mode="min", patience=2)
    trainer = Trainer(
        accelerator="cpu", devices=DEVICES, strategy=STRATEGY, max_epochs=10, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=OUT, logger=CSVLogger(OUT, name="logs"),
        callbacks=[checkpoint, stopping, LearningRateMonitor(logging_interval="epoch")],
    )  # fmt: skip
    trainer.fit(model, train, val)
    record = {
        "val_losses": model.val_losses,
        "best_k_models": {name(p): float(s) for p, s in checkpoint.best_k_models.items()},
        "best_model_path": name(checkpoint.best_model_path),
        "best_model_score": float(checkpoint.best_model_score),
        "kth_best_model_path": name(checkpoint.kth_best_model_path),
        "final_weights": weights(model),
        "stopped_epoch": stopping.stopped_epoch,
        "csv": csv_columns(Path(trainer.logger.log_dir) / "metrics.csv"),
        "test": trainer.test(model, val, ckpt_path="best"),  # the fitted module (under FSDP: sharded)
    }
    best = LitAutoEncoder.load_from_checkpoint(checkpoint.best_model_path)
    record["loaded_hparams"] = dict(best.hparams)
    record["loaded_weights"] = weights(best)
    record["predict"] = [p.tolist() for p in trainer.predict(best, val)]
    if FRAMEWORK == "trainer":  # the one-call full weights, and what the folder keeps
        record["full_state_dict_best"] = {
            k: v.flatten().tolist() for k, v in trainer.full_state_dict("best").items()
        }
        record["full_state_dict_last"] = {
            k: v.flatten().tolist() for k, v in trainer.full_state_dict().items()
        }
        record["folder"] = sorted(p.name for p in checkpoint.dirpath.iterdir() if not p.name.startswith("."))
        record["best_model_dir"] = checkpoint.best_model_path
    (OUT / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    # Lightning leaves its gloo group to the interpreter's finalisation, where its threads can abort the
    # process after the run ("terminate called without an active exception", seen in CI): shut it down here
    destroy_process_group()
