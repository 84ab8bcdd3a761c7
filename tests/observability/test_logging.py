"""Per-step metrics reach every logger from rank zero; the progress bar shows loss, lr and speed."""

import json
import subprocess
import sys

import pytest
from helpers import Regression, TinyLM, quiet, read_metrics, regression_loader, tiny_lm_loader

from trainer import Trainer
from trainer.loggers import TensorBoardLogger


def test_each_logged_step_has_loss_lr_grad_norm_and_speed(tmp_path):
    trainer = Trainer(max_steps=6, log_every_n_steps=3, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(TinyLM(), tiny_lm_loader())
    assert (trainer.state.samples_seen, trainer.state.tokens_seen) == (
        6 * 8,
        6 * 8 * 16,
    )  # checkpointed counters
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6]
    for row in rows:
        for key in (
            "train/loss",
            "train/lr",
            "train/grad_norm",
            "train/step_time_s",
            "train/samples_per_s",
            "train/tokens_per_s",
        ):
            assert key in row and row[key] > 0, key
        assert row["train/tokens_per_s"] == pytest.approx(
            row["train/samples_per_s"] * 16, rel=1e-6
        )  # seq_len 16


def test_self_log_values_are_averaged_over_micro_batches(tmp_path):
    class Logs(Regression):
        def training_step(self, batch, batch_idx):
            self.log("batch_idx", float(batch_idx), sync_dist=True)
            return super().training_step(batch, batch_idx)

    Trainer(max_steps=2, accumulate_grad_batches=4, default_root_dir=tmp_path, **quiet()).fit(
        Logs(), regression_loader()
    )
    assert read_metrics(tmp_path, "batch_idx") == {1: 1.5, 2: 5.5}  # mean of 0..3, then of 4..7


def test_a_fresh_run_in_the_same_directory_keeps_the_old_metrics(tmp_path):
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    Trainer(max_steps=3, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    files = sorted(p.name for p in (tmp_path / "logs").glob("metrics*.jsonl"))
    assert len(files) == 2 and "metrics.jsonl" in files
    assert list(read_metrics(tmp_path)) == [1, 2, 3]


def test_tensorboard_logger_writes_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Trainer(max_steps=4, loggers=[TensorBoardLogger()], default_root_dir=tmp_path, **quiet()).fit(
        Regression(), regression_loader()
    )
    events = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"))  # Lightning's layout
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]


def test_tensorboard_missing_is_said_clearly(monkeypatch):
    monkeypatch.setattr(
        "trainer.loggers.tensorboard._TENSORBOARD_AVAILABLE", False
    )  # the RequirementCache's answer
    with pytest.raises(
        ImportError, match="TensorBoardLogger needs the 'tensorboard' package, which is not installed"
    ):
        TensorBoardLogger()


def test_progress_bar_shows_step_loss_lr_and_speed(tmp_path, capfd):
    Trainer(max_steps=4, log_every_n_steps=2, default_root_dir=tmp_path, enable_checkpointing=False).fit(
        TinyLM(), tiny_lm_loader()
    )
    err = capfd.readouterr().err
    assert "4/4" in err and "loss=" in err and "lr=" in err and "tok/s=" in err


def test_importing_trainer_loads_torch_and_little_else():
    """Importing the trainer, strategies and callbacks loads neither the Hugging Face libraries and loggers nor
    what only some runs use: DTensor and DCP (FSDP, tp, sharded checkpoints) and dynamo (compile, pipelines),
    each ~0.4 s of every process's start-up."""
    lazy = (
        "transformers",
        "datasets",
        "wandb",
        "tensorboard",
        "torch.distributed.tensor",
        "torch.distributed.checkpoint",
        "torch._dynamo",
    )
    code = f"import sys, trainer, strategies, callbacks; print(sorted(m for m in {lazy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("flag, name", [("bf16", "bf16-mixed"), ("32", "32")])
def test_the_run_hyperparameters_name_its_precision(tmp_path, flag, name):
    Trainer(max_steps=1, precision=flag, default_root_dir=tmp_path, **quiet(enable_checkpointing=False)).fit(
        Regression(), regression_loader()
    )
    hparams = json.loads((tmp_path / "logs" / "hparams.json").read_text())
    assert hparams["precision"] == name
    assert (hparams["max_steps"], hparams["strategy"], hparams["module"]) == (1, "single", "Regression")
