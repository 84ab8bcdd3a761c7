"""Lightning's documented examples (tests/scripts/lightning_parity.py) run on PyTorch Lightning and here with only
the import changed, on 1 process (every `configure_optimizers` form) and under DDP on 2 processes: the
same hooks in the same order, learning rates, losses, logged metrics (torchmetrics ones included, synced
over the ranks), the trainer's attributes, validate/test/predict results and final weights. The one difference on purpose (README, "Coming from Lightning") is applied to Lightning's
hook order before comparing: `on_before_zero_grad` fires after the optimizer step here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import SCRIPTS, run_ranks

SCRIPT = SCRIPTS / "lightning_parity.py"
FORMS = ["plain", "list", "lists", "dict", "step_interval", "plateau", "onecycle", "half_epoch"]
UNSYNCED_WARNING = "log('train_acc') aggregates over the epoch without sync_dist=True under 2 processes"


def run_both(tmp_path: Path, devices: int, forms: list[str]) -> dict[str, dict[str, list[dict]]]:
    """{framework: {form: [rank 0's record, rank 1's, ...]}}; our run's stderr under "stderr"."""
    results: dict = {}
    for framework in ("lightning", "trainer"):
        out = tmp_path / framework
        proc = run_ranks(devices, SCRIPT, framework, str(out), ",".join(forms), timeout=240)
        results[framework] = {
            form: [json.loads((out / form / f"rank{r}.json").read_text()) for r in range(devices)]
            for form in forms
        }
    results["stderr"] = proc.stderr
    return results


def as_here(calls: list[str], interval_validation: bool = False) -> list[str]:
    """Lightning's order with on_before_zero_grad moved from before the backward to after
    on_before_optimizer_step (here the gradients are cleared once the optimizer has stepped); with
    `interval_validation` (val_check_interval), a step's on_train_batch_end moved after the validation that
    follows it (here that validation belongs to the step: its batch-end callbacks, a checkpoint, see it)."""
    out, held = [], []
    for name in calls:
        if name.endswith("on_before_zero_grad"):
            held.append(name)
            continue
        out.append(name)
        if name == "on_before_optimizer_step":
            out += held
            held = []
    assert not held
    if not interval_validation:
        return out
    moved, batch_end = [], []
    for i, name in enumerate(out):
        ends_a_step = name.endswith("on_train_batch_end")
        if ends_a_step and "on_validation_model_zero_grad" in out[i + 1 : i + 3]:
            batch_end.append(name)
            continue
        moved.append(name)
        if name == "on_validation_model_train" and batch_end:
            moved += batch_end
            batch_end = []
    assert not batch_end
    return moved


def assert_same_run(lightning: dict, here: dict, interval_validation: bool = False) -> None:
    for phase in ("fit_calls", "validate_calls", "test_calls", "predict_calls"):
        assert here[phase] == as_here(lightning[phase], interval_validation and phase == "fit_calls"), phase
    assert [s["lr"] for s in here["steps"]] == pytest.approx([s["lr"] for s in lightning["steps"]], rel=1e-12)
    assert [(s["epoch"], s["step"]) for s in here["steps"]] == [
        (s["epoch"], s["step"]) for s in lightning["steps"]
    ]
    assert [s["loss"] for s in here["steps"]] == pytest.approx(
        [s["loss"] for s in lightning["steps"]], abs=1e-6
    )
    assert here["hparams"] == lightning["hparams"]
    assert here["datamodule_hparams"] == lightning["datamodule_hparams"]
    assert here["attrs"] == lightning["attrs"]
    for kind in ("logged_metrics", "callback_metrics"):  # every name Lightning has, with its value
        theirs, ours = lightning[kind], here[kind]
        assert {k: ours.get(k) for k in theirs} == pytest.approx(theirs, abs=1e-6), kind
        assert all("/" in k or k == "epoch" for k in set(ours) - set(theirs)), kind  # plus our own train/*
    (validated,), (tested,) = lightning["validate"], lightning["test"]  # Lightning: a dict per loader
    assert here["validate"] == pytest.approx(validated, abs=1e-6)
    assert here["test"] == pytest.approx(tested, abs=1e-6)
    assert here["predict"] == lightning["predict"]
    for name, value in lightning["weights"].items():
        assert here["weights"][name] == pytest.approx(value, abs=1e-6), name


@pytest.mark.slow
def test_every_configure_optimizers_form_runs_as_under_lightning(tmp_path):
    results = run_both(tmp_path, 1, FORMS)
    for form in FORMS:
        (lightning,), (here,) = results["lightning"][form], results["trainer"][form]
        assert_same_run(lightning, here, interval_validation=form == "half_epoch")
    validations = {f: results["trainer"][f][0]["fit_calls"].count("on_validation_start") for f in FORMS}
    assert validations["half_epoch"] - 1 == 2 * (validations["plain"] - 1) == 6  # twice an epoch, then sanity
    lrs = {form: {s["lr"] for s in results["trainer"][form][0]["steps"]} for form in FORMS}
    assert len(lrs["plain"]) == len(lrs["list"]) == 1  # no scheduler
    assert all(
        len(lrs[f]) > 1 for f in ("lists", "dict", "step_interval", "plateau", "onecycle")
    )  # each one moved the lr
    # 96 samples in batches of 8 for 3 epochs; OneCycleLR would refuse a 37th step
    attrs = results["trainer"]["onecycle"][0]["attrs"]
    assert (attrs["estimated_stepping_batches"], attrs["num_training_batches"]) == (36, 12)
    assert attrs["intervals"] == ["step"] and attrs["precision"] == "32-true"
    metrics = results["trainer"]["onecycle"][0]["callback_metrics"]
    torchmetrics_names = {
        "train_accuracy_step",
        "train_accuracy_epoch",
        "val_accuracy",
        "val_tm_acc",
        "val_tm_f1",
    }
    assert torchmetrics_names <= set(metrics)
    assert metrics["val_accuracy"] != metrics["val_tm_acc"]  # macro (torchmetrics' default) vs micro average


@pytest.mark.slow
def test_under_ddp_on_two_processes_each_rank_runs_as_under_lightning(tmp_path):
    forms = ["plateau", "onecycle", "half_epoch"]
    results = run_both(tmp_path, 2, forms)
    for form in forms:
        for rank in range(2):
            here, lightning = results["trainer"][form][rank], results["lightning"][form][rank]
            assert_same_run(lightning, here, interval_validation=form == "half_epoch")
    first, second = results["trainer"]["onecycle"]
    # torchmetrics synced its states over the ranks; a value logged without sync_dist is each rank's own
    assert first["callback_metrics"]["val_accuracy"] == second["callback_metrics"]["val_accuracy"]
    assert first["callback_metrics"]["train_acc_epoch"] != second["callback_metrics"]["train_acc_epoch"]
    assert first["attrs"]["world_size"] == 2 and first["attrs"]["estimated_stepping_batches"] == 18
    assert results["stderr"].count(UNSYNCED_WARNING) == 3  # once per fit (of the three forms), from rank 0
    ranks = results["trainer"]["plateau"]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # replicas stayed in sync
    assert ranks[0]["steps"] != ranks[1]["steps"]  # on different halves of the data
    assert [c for c in ranks[1]["fit_calls"] if c.endswith("prepare_data")] == []  # once per node: rank 0
