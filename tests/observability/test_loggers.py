"""Loggers as Lightning's docs use them: `CSVLogger(save_dir, name=, version=)`, `TensorBoardLogger`,
`WandbLogger` from `trainer.loggers`, versioned `version_N` folders that follow the run-folder ownership
rules, `log_hyperparams`, and `self.logger` / `trainer.logger(s)`. The CSV file is compared with the one
PyTorch Lightning's CSVLogger writes for the same logged values. (Under DDP, every rank's `self.logger`
reads rank zero's version: tests/test_lightning_module.py's DDP run.)"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import yaml
from helpers import StopAt, regression_data
from torch import nn
from torch.utils.data import DataLoader

from trainer import Trainer, TrainModule
from trainer.checkpoint import run_folder
from trainer.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger


class LitModel(TrainModule):
    """Lightning's docs' shape: `save_hyperparameters`, a per-step training loss, a validation loss."""

    def __init__(self, lr: float = 0.1, hidden: int = 4):
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(8, 1)
        self.seen_loggers: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, prog_bar=True)
        self.seen_loggers.append((self.logger, list(self.loggers)))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def loaders():
    data = regression_data(48)
    return DataLoader(data, batch_size=16), DataLoader(data, batch_size=16)


def fit(tmp_path, logger, max_epochs=2, **kwargs):
    trainer = Trainer(
        max_epochs=max_epochs, logger=logger, log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path / "root", **kwargs,
    )  # fmt: skip
    module = LitModel()
    trainer.fit(module, *loaders())
    return trainer, module


class Recorder(Logger):
    """A logger that keeps every call, to replay the same values into Lightning's CSVLogger."""

    def __init__(self):
        self.rows, self.hparams = [], None

    def log_hyperparams(self, params):
        self.hparams = params

    def log_metrics(self, metrics, step=None):
        self.rows.append((dict(metrics), step))


def test_csv_logger_writes_what_lightnings_csv_logger_writes_for_the_same_values(tmp_path):
    from pytorch_lightning.loggers import CSVLogger as LightningCSVLogger

    logger, recorder = CSVLogger(tmp_path / "logs", name="lit"), Recorder()
    recorder.trainer_metrics = False  # the values the CSV logger got
    fit(tmp_path, [logger, recorder])
    theirs = LightningCSVLogger(tmp_path / "lightning", name="lit")
    theirs.log_hyperparams(recorder.hparams)
    for metrics, step in recorder.rows:
        theirs.log_metrics(metrics, step)
    theirs.finalize("success")
    assert logger.log_dir == str(tmp_path / "logs" / "lit" / "version_0") and theirs.version == 0
    for name in ("metrics.csv", "hparams.yaml"):
        mine = (tmp_path / "logs" / "lit" / "version_0" / name).read_text()
        assert mine == (tmp_path / "lightning" / "lit" / "version_0" / name).read_text(), name


def test_a_lightning_users_pandas_code_reads_the_csv(tmp_path):
    trainer, _ = fit(tmp_path, CSVLogger(tmp_path / "logs"))
    metrics = pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")
    assert list(metrics.columns) == ["epoch", "step", "train_loss", "val_loss"]  # what the module logged
    assert metrics["train_loss"].notna().sum() == 6 and metrics["val_loss"].notna().sum() == 2
    per_epoch = metrics.groupby("epoch")["val_loss"].last()
    assert list(per_epoch.index) == [0, 1] and per_epoch.notna().all()
    assert yaml.safe_load(open(f"{trainer.logger.log_dir}/hparams.yaml")) == {"lr": 0.1, "hidden": 4}


def test_the_module_and_the_trainer_see_the_first_logger_and_all_loggers(tmp_path):
    first, second = Recorder(), Recorder()
    trainer, module = fit(tmp_path, [first, second], max_epochs=1)
    assert trainer.logger is first and trainer.loggers[:2] == [first, second]
    assert type(trainer.loggers[-1]).__name__ == "JSONLLogger"  # the always-on log comes last
    seen_first, seen_all = module.seen_loggers[0]
    assert seen_first is first and seen_all == trainer.loggers
    assert first.hparams == {"lr": 0.1, "hidden": 4}  # log_hyperparams: the module's, as Lightning's


def test_tensorboard_logger_takes_lightnings_arguments(tmp_path):
    tb = TensorBoardLogger(tmp_path / "tb", name="exp")
    trainer, _ = fit(tmp_path, tb, max_epochs=1)
    assert (tb.name, tb.version, tb.save_dir) == ("exp", 0, str(tmp_path / "tb"))
    assert tb.log_dir == trainer.log_dir == str(tmp_path / "tb" / "exp" / "version_0")
    assert list((tmp_path / "tb" / "exp" / "version_0").glob("events.out.tfevents.*"))
    with pytest.raises(ValueError, match=r"TensorBoardLogger log_graph=True is not supported"):
        TensorBoardLogger(tmp_path, log_graph=True)
    assert yaml.safe_load((tmp_path / "tb" / "exp" / "version_0" / "hparams.yaml").read_text()) == {
        "lr": 0.1,
        "hidden": 4,
    }


def test_each_fresh_run_takes_the_next_free_version(tmp_path):
    versions = []
    for _ in range(3):
        logger = CSVLogger(tmp_path / "logs", name="lit")
        fit(tmp_path, logger, max_epochs=1)
        versions.append((logger.version, logger.log_dir))
    assert versions == [(n, str(tmp_path / "logs" / "lit" / f"version_{n}")) for n in range(3)]
    for n in range(3):  # every run's own file, untouched by the later ones
        rows = pd.read_csv(tmp_path / "logs" / "lit" / f"version_{n}" / "metrics.csv")
        assert rows["train_loss"].notna().sum() == 3


def test_a_logger_without_save_dir_writes_under_default_root_dir(tmp_path):
    trainer, _ = fit(tmp_path, "csv", max_epochs=1)
    assert trainer.logger.log_dir == str(tmp_path / "root" / "lightning_logs" / "version_0")
    assert (tmp_path / "root" / "lightning_logs" / "version_0" / "metrics.csv").exists()


def test_an_explicit_version_holding_another_runs_logs_is_refused_and_kept(tmp_path):
    fit(tmp_path, CSVLogger(tmp_path / "logs", version=0), max_epochs=1)
    before = (tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    with pytest.raises(
        ValueError, match=r"CSVLogger\(version=0\): .*version_0 holds the logs of another run"
    ):
        fit(tmp_path, CSVLogger(tmp_path / "logs", version=0), max_epochs=1)
    assert (tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv").read_text() == before
    named = CSVLogger(tmp_path / "logs", version="baseline")  # a folder name, as Lightning allows
    fit(tmp_path, named, max_epochs=1)
    assert named.log_dir == str(tmp_path / "logs" / "lightning_logs" / "baseline")


def test_a_folder_a_live_fit_holds_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "logs" / "lightning_logs" / "version_0"
    lock, _ = run_folder.acquire(folder, "live-run")  # another fit, still running
    try:
        with pytest.raises(
            run_folder.FolderInUse, match=r"CSVLogger folder .*version_0 is in use by run live-run"
        ):
            fit(tmp_path, CSVLogger(tmp_path / "logs", version=0), max_epochs=1)
        automatic = CSVLogger(tmp_path / "logs")  # the next free version is another folder
        fit(tmp_path, automatic, max_epochs=1)
        assert automatic.version == 1
    finally:
        lock.release()


def test_a_resumed_run_continues_its_own_version_without_repeated_steps(tmp_path):
    loader = DataLoader(regression_data(96), batch_size=16)  # 6 steps per epoch

    def run(ckpt_path=None, callbacks=()):
        trainer = Trainer(
            max_steps=6, logger=CSVLogger(tmp_path / "logs"), log_every_n_steps=1, enable_progress_bar=False,
            seed=0, default_root_dir=tmp_path / "root", callbacks=list(callbacks),
        )  # fmt: skip
        trainer.fit(LitModel(), loader, ckpt_path=ckpt_path)
        return trainer

    run(callbacks=[StopAt(4)])  # preempted after step 4
    trainer = run(ckpt_path="last")  # the same command again, resuming
    assert trainer.logger.version == 0
    rows = pd.read_csv(tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv")
    assert rows.loc[rows["train_loss"].notna(), "step"].tolist() == [1, 2, 3, 4, 5, 6]
    assert not (tmp_path / "logs" / "lightning_logs" / "version_1").exists()


def test_a_bad_version_is_named():
    with pytest.raises(ValueError, match=r"CSVLogger version=-1 is invalid; allowed: None"):
        CSVLogger("logs", version=-1)


def test_wandb_logger_with_lightnings_arguments_runs_offline_without_an_api_key(tmp_path, monkeypatch):
    """(moved here from test_logging.py, with Lightning's arguments)"""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no key, so no network and no prompt
    import wandb

    logged = []  # the artifacts the run was given (the offline record is written by wandb's service)
    log_artifact = wandb.sdk.wandb_run.Run.log_artifact
    monkeypatch.setattr(
        wandb.sdk.wandb_run.Run,
        "log_artifact",
        lambda run, artifact, **kw: logged.append(artifact) or log_artifact(run, artifact, **kw),
    )
    logger = WandbLogger(project="lit", name="first", log_model=True)  # save_dir: default_root_dir
    trainer, _ = fit(tmp_path, logger, max_epochs=1)
    assert trainer.logger is logger and logger.name == "lit" and logger.save_dir == str(tmp_path / "root")
    runs = list((tmp_path / "root" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith(logger.version) and list(runs[0].glob("*.wandb"))
    (artifact,) = logged  # log_model: the run's checkpoint folder as one "model" artifact at the end
    assert (artifact.name, artifact.type) == (f"model-{logger.version}", "model")
    assert "step-00000003/model.safetensors" in artifact.manifest.entries
    with pytest.raises(ValueError, match=r"WandbLogger\(offline=True, log_model=True\): an offline run"):
        WandbLogger(offline=True, log_model=True)


def test_wandb_rows_are_keyed_by_global_step_as_lightnings_so_none_is_dropped(tmp_path, monkeypatch):
    """wandb drops a row logged with `step=` lower than its last; Lightning logs `trainer/global_step` as a
    metric (the x-axis of every other) instead. The same rows through Lightning's WandbLogger: the same calls."""
    from pytorch_lightning.loggers import WandbLogger as LightningWandbLogger

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    import wandb

    calls = []
    for name in ("log", "define_metric"):
        real = getattr(wandb.sdk.wandb_run.Run, name)
        monkeypatch.setattr(
            wandb.sdk.wandb_run.Run,
            name,
            lambda run, *a, _name=name, _real=real, **kw: (
                calls.append((_name, a, kw)) or _real(run, *a, **kw)
            ),
        )
    fit(tmp_path, WandbLogger(project="lit"), max_epochs=2)
    ours, calls[:] = list(calls), []
    logs = [a[0] for name, a, kw in ours if name == "log"]
    assert all(kw == {} for name, a, kw in ours if name == "log")  # no wandb step: no row can be dropped
    assert any(k.startswith("val") for row in logs for k in row) and all(
        "trainer/global_step" in r for r in logs
    )

    theirs = LightningWandbLogger(project="lit", save_dir=tmp_path / "pl", mode="offline")
    for row in logs:
        step = row["trainer/global_step"]
        theirs.log_metrics({k: v for k, v in row.items() if k != "trainer/global_step"}, step=step)
    theirs.experiment.finish()
    assert [c for c in calls if c[0] == "define_metric"] == [c for c in ours if c[0] == "define_metric"]
    assert [c for c in calls if c[0] == "log"] == [c for c in ours if c[0] == "log"]
