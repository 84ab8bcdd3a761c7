"""Lightning's own examples (examples/pytorch/ at commit 7f0c3436cd) run on PyTorch Lightning and here with their
imports as the only change, as their main runs them (examples/run.py), on generated data, same seeds and the
same Trainer flags. Lightning's code is not copied into this repository: every example is read from a Lightning
checkout (LIGHTNING_EXAMPLES=<checkout>/examples/pytorch; skipped without it: CI has none) by examples/upstream.py.
`basics/autoencoder.py` and `basics/backbone_image_classifier.py` run as their `cli_main` (fit,
test(ckpt_path="best"), predict(ckpt_path="best")):
the same optimizer steps and epochs, the values a callback reads after every step and validation,
`callback_metrics` and `logged_metrics`, the rows of the CSV log, the checkpoints kept and the one "best"
reads, the final weights, and what test and predict return; the classifier also under DDP on 2 processes,
rank by rank. `domain_templates/generative_adversarial_net.py` (manual optimization, two optimizers; 1 and 2
processes) and `domain_templates/computer_vision_fine_tuning.py` (BaseFinetuning, a scheduler, torchmetrics)
are compared the same way, the GAN's TensorBoard scalars and images too. The differences on purpose (README,
"Coming from Lightning") are applied to Lightning's side before comparing: a training row's `step` counts
the optimizer steps done (one more; under manual optimization Lightning counts batches), a checkpoint is a
directory named `step-XXXXXXXX` by default, `test` returns one dict, validation draws nothing from the
training's random generators (run.py gives Lightning's evaluation loop a copy of them), and under DDP a
train loader with `shuffle=False` is not shuffled (run.py makes Lightning's DistributedSampler follow it)."""

from __future__ import annotations

import csv
import io
import json
import os
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


# every example is read from a Lightning checkout (examples/upstream.py)
needs_upstream = pytest.mark.skipif(
    not os.environ.get("LIGHTNING_EXAMPLES"),
    reason="LIGHTNING_EXAMPLES (a Lightning checkout's examples/pytorch folder) is unset",
)


def run_both(
    tmp_path: Path, example: str, devices: int, flags: dict | None = None, arguments: dict | None = None
) -> dict[str, list[dict]]:
    """{framework: [rank 0's record, rank 1's, ...]} of `example` run by examples/run.py with FLAGS (FLAGS
    above by default) and the example's own command-line ARGUMENTS; "{out}" in an argument is the run's
    folder."""
    results = {}
    for framework in ("lightning", "trainer"):
        out = tmp_path / framework
        flags_json = json.dumps({**(FLAGS if flags is None else flags), "default_root_dir": str(out)})
        own = json.dumps(
            {k: v.format(out=out) if isinstance(v, str) else v for k, v in (arguments or {}).items()}
        )
        run_ranks(devices, RUN, framework, example, str(out), flags_json, "--arguments", own, timeout=240)
        results[framework] = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(devices)]
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


def assert_same_weights(lightning: dict, here: dict) -> None:
    """The same tensors under the same names, within float tolerance."""
    assert list(here) == list(lightning)
    for name, value in lightning.items():
        torch.testing.assert_close(here[name], value, atol=1e-6, rtol=0, msg=name)


def same_tensors(first: dict, second: dict) -> bool:
    return list(first) == list(second) and all(torch.equal(first[k], second[k]) for k in first)


def assert_same_fit(lightning: dict, here: dict) -> None:
    """The steps and epochs, what each batch trained and the values after it and after each validation,
    `callback_metrics`/`logged_metrics`, the final weights and the checkpoints kept."""
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
    assert_same_weights(fit_l["weights"], fit_h["weights"])
    ckpt_l, ckpt_h = fit_l["checkpoints"], fit_h["checkpoints"]
    assert ckpt_h["steps"] == ckpt_l["steps"]  # the same checkpoints kept...
    assert ckpt_l["kept"] == [f"epoch={fit_l['current_epoch'] - 1}-step={s}.ckpt" for s in ckpt_l["steps"]]
    assert ckpt_h["kept"] == [f"step-{s:08d}" for s in ckpt_l["steps"]]
    assert ckpt_h["best"] == ckpt_h["kept"][-1] and ckpt_l["best"] == ckpt_l["kept"][-1]  # ...and "best"
    assert_same_weights(ckpt_l["best_weights"], ckpt_h["best_weights"])


def assert_same_csv(lightning: dict, here: dict) -> None:
    """Every row of the CSVLogger's metrics.csv."""
    rows_l = csv_rows(lightning["fit"]["metrics_csv"], True)
    rows_h = csv_rows(here["fit"]["metrics_csv"], False)
    assert [set(row) for row in rows_h] == [set(row) for row in rows_l]
    for theirs, ours in zip(rows_l, rows_h, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-6), f"metrics.csv row {theirs}"


def assert_same_tensorboard(lightning: dict, here: dict) -> None:
    """Every scalar and image of the TensorBoard events. A manually optimized run's scalars are at the batch
    count under Lightning and at the optimizer steps done here (README): the step the batch's callback saw;
    `hp_metric` (-1, at 0) is logged before any batch."""
    board_l, board_h = lightning["fit"]["tensorboard"], here["fit"]["tensorboard"]
    steps_after = [entry["step"] for entry in here["steps"]]
    assert set(board_h["scalars"]) == set(board_l["scalars"])
    for tag, points in board_l["scalars"].items():
        steps = [s for s, _ in points] if tag == "hp_metric" else [steps_after[s] for s, _ in points]
        assert [s for s, _ in board_h["scalars"][tag]] == steps, tag
        assert [v for _, v in board_h["scalars"][tag]] == pytest.approx([v for _, v in points], abs=1e-6), tag
    assert set(board_h["images"]) == set(board_l["images"])
    for tag, images in board_l["images"].items():
        assert [step for step, _ in board_h["images"][tag]] == [step for step, _ in images], tag
        for (_, theirs), (_, ours) in zip(images, board_h["images"][tag], strict=True):
            # 8-bit pixels of generated images: equal weights give equal pixels, a last-digit float
            # difference at most one level
            torch.testing.assert_close(ours.int(), theirs.int(), atol=1, rtol=0)


def assert_same_run(lightning: dict, here: dict) -> None:
    """A LightningCLI example's whole run: its fit and CSV log, then test and predict from "best"."""
    assert_same_fit(lightning, here)
    assert_same_csv(lightning, here)
    (tested,) = lightning["test"]  # Lightning: a dict per test loader
    assert_same_metrics(tested, here["test"], "test")
    assert len(here["predict"]) == len(lightning["predict"])
    for theirs, ours in zip(lightning["predict"], here["predict"], strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-6, rtol=0)
    assert here["rank_zero_only"] == lightning["rank_zero_only"]


@pytest.mark.slow
@needs_upstream
def test_autoencoder_runs_as_under_lightning(tmp_path):
    results = run_both(tmp_path, "autoencoder", 1)
    (lightning,), (here,) = results["lightning"], results["trainer"]
    assert_same_run(lightning, here)
    # the run logged per step in validation and test (`on_step=True`) and a row every 3 steps, and kept the
    # last epoch's checkpoint, which test and predict read
    assert here["fit"]["global_step"] == 8 and here["fit"]["checkpoints"]["steps"] == [8]
    assert {"val_loss_step", "val_loss_epoch", "train_loss"} <= set(here["fit"]["logged_metrics"])
    assert [r["step"] for r in csv_rows(here["fit"]["metrics_csv"], False) if "train_loss" in r] == [3, 6]
    assert same_tensors(here["fit"]["checkpoints"]["best_weights"], here["fit"]["weights"])
    assert len(here["predict"]) == 2 and len(here["predict"][0][0]) == 28 * 28


@pytest.mark.slow
@needs_upstream
def test_backbone_image_classifier_runs_as_under_lightning(tmp_path):
    results = run_both(tmp_path, "backbone_image_classifier", 1)
    (lightning,), (here,) = results["lightning"], results["trainer"]
    assert_same_run(lightning, here)
    assert {"train_loss_step", "train_loss_epoch", "valid_loss_step"} <= set(here["fit"]["logged_metrics"])
    assert len(here["predict"][0][0]) == 10  # the backbone's 10 class scores


@pytest.mark.slow
@needs_upstream
def test_backbone_image_classifier_under_ddp_on_two_processes_runs_as_under_lightning(tmp_path):
    results = run_both(tmp_path, "backbone_image_classifier", 2)
    for rank in range(2):
        assert_same_run(results["lightning"][rank], results["trainer"][rank])
    first, second = results["trainer"]
    assert same_tensors(first["fit"]["weights"], second["fit"]["weights"])  # the replicas stayed in sync...
    assert first["steps"] != second["steps"]  # ...on different halves of the data
    assert first["predict"] != second["predict"]  # each rank predicts its own half
    assert (first["rank_zero_only"], second["rank_zero_only"]) == ("ran", None)


# the GAN (manual optimization: each batch steps the generator, then the discriminator): 2 epochs of 4 batches
GAN_FLAGS = {
    "max_epochs": 2, "limit_train_batches": 4, "log_every_n_steps": 3, "enable_progress_bar": False,
    "enable_model_summary": False,
}  # fmt: skip


@pytest.mark.slow
@needs_upstream
def test_generative_adversarial_net_runs_as_under_lightning(tmp_path):
    results = run_both(tmp_path, "generative_adversarial_net", 1, GAN_FLAGS)
    (lightning,), (here,) = results["lightning"], results["trainer"]
    assert_same_fit(lightning, here)
    assert_same_tensorboard(lightning, here)
    # two optimizer steps a batch; the losses each batch logged (log_dict), read at its on_train_batch_end
    assert [s["step"] for s in here["steps"]] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert all(set(s["metrics"]) == {"d_loss", "g_loss"} for s in here["steps"])
    assert len({s["metrics"]["d_loss"] for s in here["steps"]}) == 8
    # a row every 3 batches; the generated images at each epoch's end
    assert [s for s, _ in here["fit"]["tensorboard"]["scalars"]["g_loss"]] == [6, 12]
    assert [s for s, _ in here["fit"]["tensorboard"]["images"]["generated_images"]] == [0, 1]


@pytest.mark.slow
@needs_upstream
def test_generative_adversarial_net_under_ddp_on_two_processes_runs_as_under_lightning(tmp_path):
    # Lightning's GAN under DDP needs unused parameters found: each step leaves the other network's out
    flags = {**GAN_FLAGS, "strategy": "ddp_find_unused_parameters_true"}
    results = run_both(tmp_path, "generative_adversarial_net", 2, flags)
    for rank in range(2):
        assert_same_fit(results["lightning"][rank], results["trainer"][rank])
    assert_same_tensorboard(results["lightning"][0], results["trainer"][0])
    first, second = results["trainer"]
    assert same_tensors(first["fit"]["weights"], second["fit"]["weights"])  # the replicas stayed in sync...
    assert first["steps"] != second["steps"]  # ...on different halves of the data
    assert first["fit"]["global_step"] == 16


@pytest.mark.slow
@needs_upstream
def test_computer_vision_fine_tuning_runs_as_under_lightning(tmp_path):
    # as `python computer_vision_fine_tuning.py fit --data.batch_size=2 --finetuning.milestones=[1,2] ...`:
    # the feature extractor's last 5 layers unfrozen at epoch 1, the rest at epoch 2, the LR x0.1 at both
    flags = {
        "max_epochs": 3, "limit_train_batches": 2, "limit_val_batches": 1, "log_every_n_steps": 1,
        "enable_progress_bar": False,
    }  # fmt: skip
    arguments = {"data.batch_size": 2, "data.dl_path": "{out}/data", "finetuning.milestones": [1, 2]}
    results = run_both(tmp_path, "computer_vision_fine_tuning", 1, flags, arguments)
    (lightning,), (here,) = results["lightning"], results["trainer"]
    assert_same_fit(lightning, here)
    assert_same_csv(lightning, here)
    groups = [s["param_groups"][0] for s in here["steps"][::2]]  # each epoch's, as its first batch trains
    assert [[count for _, count in epoch] for epoch in groups] == [[6], [6, 4], [6, 4, 1]]
    assert [s["trainable"] for s in here["steps"][::2]] == [6, 18, 21]
    assert groups[1][0][0] == pytest.approx(1e-4) and groups[2][0][0] == pytest.approx(1e-5)
    assert {"train_acc", "val_loss", "val_acc"} <= set(here["fit"]["callback_metrics"])
