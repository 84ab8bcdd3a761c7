"""Lightning's own examples (examples/pytorch/ at commit 7f0c3436cd, vendored in tests/lightning/examples/ with
their imports as the only change) run on PyTorch Lightning and here, as their `cli_main` runs them
(examples/run.py: fit, test(ckpt_path="best"), predict(ckpt_path="best")), on generated MNIST, same seeds and
the same Trainer flags: the same optimizer steps and epochs, the values a callback reads after every step and
validation, `callback_metrics` and `logged_metrics`, the rows of the CSV log, the checkpoints kept and
the one "best" reads, the final weights, and what test and predict return; the classifier also under DDP on
2 processes, rank by rank. The differences on purpose (README, "Coming from Lightning") are applied to
Lightning's side before comparing: a training row's `step` counts the optimizer steps done (one more), a
checkpoint is a directory named `step-XXXXXXXX` by default, `test` returns one dict, and under DDP a train
loader with `shuffle=False` is not shuffled (run.py makes Lightning's DistributedSampler follow it)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import torch
from helpers import run_ranks

RUN = Path(__file__).parent / "examples" / "run.py"
# as a user passes them (`--trainer.max_epochs=2 ...`): a few batches of each loop, a row every 3 steps
FLAGS = {
    "max_epochs": 2, "limit_train_batches": 4, "limit_val_batches": 2, "limit_test_batches": 2,
    "limit_predict_batches": 2, "log_every_n_steps": 3, "enable_progress_bar": False,
    "enable_model_summary": False,
}  # fmt: skip


def run_both(tmp_path: Path, example: str, devices: int) -> dict[str, list[dict]]:
    """{framework: [rank 0's record, rank 1's, ...]} of `example` run by examples/run.py."""
    results = {}
    for framework in ("lightning", "trainer"):
        out = tmp_path / framework
        flags = json.dumps({**FLAGS, "default_root_dir": str(out)})
        run_ranks(devices, RUN, framework, example, str(out), flags, timeout=240)
        results[framework] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]
    return results


def assert_same_metrics(lightning: dict, here: dict, what: str) -> None:
    """Every name Lightning has, with its value; ours adds only this Trainer's own (`train/...`, `epoch`)."""
    assert {k: here.get(k) for k in lightning} == pytest.approx(lightning, abs=1e-6), what
    assert all("/" in k or k == "epoch" for k in set(here) - set(lightning)), what


def csv_rows(text: str, lightning: bool) -> list[dict]:
    """metrics.csv's rows, numbers as floats; Lightning's with a training row's step as here (the optimizer
    steps done: one more), a validation batch's row (no epoch) keeping its count of batches."""
    rows = []
    for row in csv.DictReader(io.StringIO(text)):
        row = {k: float(v) for k, v in row.items() if v != ""}
        if lightning and "epoch" in row:
            row["step"] += 1
        rows.append(row)
    return rows


def assert_same_run(lightning: dict, here: dict) -> None:
    fit_l, fit_h = lightning["fit"], here["fit"]
    assert (fit_h["global_step"], fit_h["current_epoch"]) == (fit_l["global_step"], fit_l["current_epoch"])
    for kind in ("steps", "validations"):
        assert [{k: v for k, v in s.items() if k != "metrics"} for s in here[kind]] == [
            {k: v for k, v in s.items() if k != "metrics"} for s in lightning[kind]
        ], kind
        for theirs, ours in zip(lightning[kind], here[kind], strict=True):
            assert_same_metrics(theirs["metrics"], ours["metrics"], f"{kind} at step {theirs['step']}")
    for kind in ("callback_metrics", "logged_metrics"):
        assert_same_metrics(fit_l[kind], fit_h[kind], kind)
    rows_l, rows_h = csv_rows(fit_l["metrics_csv"], True), csv_rows(fit_h["metrics_csv"], False)
    assert [set(row) for row in rows_h] == [set(row) for row in rows_l]
    for theirs, ours in zip(rows_l, rows_h, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-6), f"metrics.csv row {theirs}"
    for name, value in fit_l["weights"].items():
        assert fit_h["weights"][name] == pytest.approx(value, abs=1e-6), name
    ckpt_l, ckpt_h = fit_l["checkpoints"], fit_h["checkpoints"]
    assert ckpt_h["steps"] == ckpt_l["steps"]  # the same checkpoints kept...
    assert ckpt_l["kept"] == [f"epoch={fit_l['current_epoch'] - 1}-step={s}.ckpt" for s in ckpt_l["steps"]]
    assert ckpt_h["kept"] == [f"step-{s:08d}" for s in ckpt_l["steps"]]
    assert ckpt_h["best"] == ckpt_h["kept"][-1] and ckpt_l["best"] == ckpt_l["kept"][-1]  # ...and "best"
    for name, value in ckpt_l["best_weights"].items():
        assert ckpt_h["best_weights"][name] == pytest.approx(value, abs=1e-6), name
    (tested,) = lightning["test"]  # Lightning: a dict per test loader
    assert_same_metrics(tested, here["test"], "test")
    assert len(here["predict"]) == len(lightning["predict"])
    for theirs, ours in zip(lightning["predict"], here["predict"], strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-6, rtol=0)
    assert here["rank_zero_only"] == lightning["rank_zero_only"]


@pytest.mark.slow
def test_autoencoder_runs_as_under_lightning(tmp_path):
    results = run_both(tmp_path, "autoencoder", 1)
    (lightning,), (here,) = results["lightning"], results["trainer"]
    assert_same_run(lightning, here)
    # the run logged per step in validation and test (`on_step=True`) and a row every 3 steps, and kept the
    # last epoch's checkpoint, which test and predict read
    assert here["fit"]["global_step"] == 8 and here["fit"]["checkpoints"]["steps"] == [8]
    assert {"val_loss_step", "val_loss_epoch", "train_loss"} <= set(here["fit"]["logged_metrics"])
    assert [r["step"] for r in csv_rows(here["fit"]["metrics_csv"], False) if "train_loss" in r] == [3, 6]
    assert here["fit"]["checkpoints"]["best_weights"] == here["fit"]["weights"]
    assert len(here["predict"]) == 2 and len(here["predict"][0][0]) == 28 * 28


@pytest.mark.slow
def test_backbone_image_classifier_runs_as_under_lightning(tmp_path):
    results = run_both(tmp_path, "backbone_image_classifier", 1)
    (lightning,), (here,) = results["lightning"], results["trainer"]
    assert_same_run(lightning, here)
    assert {"train_loss_step", "train_loss_epoch", "valid_loss_step"} <= set(here["fit"]["logged_metrics"])
    assert len(here["predict"][0][0]) == 10  # the backbone's 10 class scores


@pytest.mark.slow
def test_backbone_image_classifier_under_ddp_on_two_processes_runs_as_under_lightning(tmp_path):
    results = run_both(tmp_path, "backbone_image_classifier", 2)
    for rank in range(2):
        assert_same_run(results["lightning"][rank], results["trainer"][rank])
    first, second = results["trainer"]
    assert first["fit"]["weights"] == second["fit"]["weights"]  # the replicas stayed in sync...
    assert first["steps"] != second["steps"]  # ...on different halves of the data
    assert first["predict"] != second["predict"]  # each rank predicts its own half
    assert (first["rank_zero_only"], second["rank_zero_only"]) == ("ran", None)
