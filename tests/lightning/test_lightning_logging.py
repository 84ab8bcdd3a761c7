"""`self.log` as Lightning's docs use it: per step in training and per epoch in validation by default,
`on_step`/`on_epoch` with Lightning's `_step`/`_epoch` names, epoch means weighted by `batch_size`,
`reduce_fx`, `logger=False`, `log_dict`, and what reaches `callback_metrics` / `logged_metrics`."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import quiet, regression_data
from torch import nn
from torch.utils.data import DataLoader

from callbacks import Callback
from trainer import Trainer, TrainModule


class LitClassifier(TrainModule):
    """Lightning's docs' shape: the step calls `self(x)` and logs; the batch sizes are uneven (16, 16, 8)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.step_values: list[tuple[float, int]] = []  # (loss, batch size) of every training batch
        self.val_values: list[tuple[float, int]] = []

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.step_values.append((loss.item(), len(x)))
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=len(x))
        self.log("biggest_batch", float(len(x)), on_step=False, on_epoch=True, reduce_fx="max")
        self.log_dict({"seen": float(len(x))}, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("debug_only", 1.0, logger=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.val_values.append((loss.item(), len(x)))
        self.log("val_loss", loss, batch_size=len(x))
        self.log_dict({"val_first_batch": float(batch_idx == 0)}, reduce_fx="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def rows(root):
    return [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]


def weighted_mean(values):
    return sum(v * n for v, n in values) / sum(n for _, n in values)


@pytest.fixture
def run(tmp_path):
    module = LitClassifier()
    loader = DataLoader(regression_data(40), batch_size=16)  # 16, 16, 8
    trainer = Trainer(max_epochs=2, default_root_dir=tmp_path, **quiet())
    trainer.fit(module, loader, DataLoader(regression_data(24, seed=1), batch_size=16))  # 16, 8
    return trainer, module, rows(tmp_path)


def test_on_step_and_on_epoch_log_lightnings_names_and_a_batch_size_weighted_epoch_mean(run):
    trainer, module, logged = run
    steps = [r["train_loss_step"] for r in logged if "train_loss_step" in r]
    assert steps == pytest.approx([v for v, _ in module.step_values], abs=1e-6)
    epochs = [r for r in logged if "train_loss_epoch" in r]
    assert [r["step"] for r in epochs] == [3, 6]  # at the end of each epoch
    for epoch, row in enumerate(epochs):
        expected = weighted_mean(module.step_values[3 * epoch : 3 * epoch + 3])
        assert row["train_loss_epoch"] == pytest.approx(expected, abs=1e-6)
        assert row["biggest_batch"] == 16.0 and row["seen"] == 40.0  # reduce_fx "max" and "sum"
    assert not any("train_loss" in r for r in logged)  # both on: only the suffixed names


def test_validation_logs_once_per_loop_weighted_by_batch_size(run):
    trainer, module, logged = run
    val_rows = [r for r in logged if "val_loss" in r]
    assert [r["step"] for r in val_rows] == [3, 6]
    first_loop = module.val_values[2:4]  # after the sanity check's two batches (not logged)
    assert val_rows[0]["val_loss"] == pytest.approx(weighted_mean(first_loop), abs=1e-6)
    assert val_rows[0]["val_first_batch"] == 1.0  # summed over the loop's batches


def test_callback_metrics_hold_everything_and_logged_metrics_only_what_loggers_got(run):
    trainer, _, logged = run
    assert trainer.callback_metrics["debug_only"] == 1.0
    assert "debug_only" not in trainer.logged_metrics
    assert not any("debug_only" in r for r in logged)
    # a name logged both ways is also under its bare name in callback_metrics, as in Lightning
    assert trainer.callback_metrics["train_loss"] == trainer.callback_metrics["train_loss_epoch"]
    assert trainer.logged_metrics["val_loss"] == trainer.callback_metrics["val_loss"]


class Logs(TrainModule):
    def __init__(self, **options):
        super().__init__()
        self.layer, self.options = nn.Linear(8, 1), options

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("x", loss, **self.options)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"reduce_fx": "median"}, ValueError, r"log\('x'\) reduce_fx='median' is unknown; allowed: mean, sum, max, min"),
        ({"on_step": False, "on_epoch": False}, ValueError, r"on_step=False and on_epoch=False; allowed: at least one"),
        ({"batch_size": 0}, ValueError, r"batch_size=0 is invalid; allowed: an int >= 1"),
    ],
)  # fmt: skip
def test_bad_log_options_are_named(tmp_path, options, error, match):
    with pytest.raises(error, match=match):
        Trainer(max_steps=1, default_root_dir=tmp_path, **quiet()).fit(
            Logs(**options), DataLoader(regression_data(16), batch_size=16)
        )


def test_torch_reduction_functions_are_accepted_as_lightning_allows(tmp_path):
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(
        Logs(reduce_fx=torch.max, on_epoch=True), DataLoader(regression_data(32), batch_size=16)
    )
    assert "x_epoch" in rows(tmp_path)[-1]


def test_what_on_train_batch_end_and_on_train_epoch_end_log_lands_where_lightning_puts_it(tmp_path):
    class EndHooks(LitClassifier):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.log("batch_end_loss", outputs["loss"])  # per step by default, at the step that ended

        def on_train_epoch_end(self):
            self.log("epoch_seen", float(self.current_epoch))  # per epoch by default

    module = EndHooks()
    Trainer(max_epochs=2, default_root_dir=tmp_path, **quiet()).fit(
        module, DataLoader(regression_data(40), batch_size=16)
    )
    logged = rows(tmp_path)
    at_batch_end = {r["step"]: r["batch_end_loss"] for r in logged if "batch_end_loss" in r}
    assert at_batch_end == pytest.approx({i + 1: v for i, (v, _) in enumerate(module.step_values)}, abs=1e-6)
    assert {r["step"]: r["epoch_seen"] for r in logged if "epoch_seen" in r} == {3: 0.0, 6: 1.0}


class Watcher(Callback):
    """What a callback reads after each optimizer step."""

    def __init__(self):
        self.callback_values, self.logged_values = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.callback_values.append(trainer.callback_metrics.get("train_loss_step"))
        self.logged_values.append(trainer.logged_metrics.get("train_loss_step"))


def test_each_step_s_values_reach_callback_and_logged_metrics_between_the_logged_rows(tmp_path):
    module, watcher = LitClassifier(), Watcher()
    Trainer(max_epochs=2, default_root_dir=tmp_path, callbacks=[watcher], **quiet(log_every_n_steps=4)).fit(
        module, DataLoader(regression_data(40), batch_size=16)
    )
    losses = [v for v, _ in module.step_values]
    # as in Lightning: both hold every step's value, the loggers get a row every 4 steps
    assert watcher.callback_values == pytest.approx(losses, abs=1e-6)
    assert watcher.logged_values == pytest.approx(losses, abs=1e-6)
    assert [r["step"] for r in rows(tmp_path) if "train_loss_step" in r] == [4]


def test_validation_on_step_values_are_rows_numbered_by_the_fit_s_validation_batches(tmp_path):
    class StepValidation(LitClassifier):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.val_values.append((loss.item(), len(x)))
            self.log("val_loss", loss, on_step=True, batch_size=len(x))

    module = StepValidation()
    trainer = Trainer(max_epochs=2, default_root_dir=tmp_path, **quiet())
    trainer.fit(
        module,
        DataLoader(regression_data(40), batch_size=16),
        DataLoader(regression_data(24, seed=1), batch_size=16),
    )
    logged = rows(tmp_path)
    # the two validations' batches: after the sanity check's two (not logged), before the step that the final
    # checkpoint's check runs (Trainer.loss_on, which logs nothing)
    batch_values = [v for v, _ in module.val_values[2:6]]
    # Lightning's rows: each validation batch at the count of the fit's validation batches before it, no epoch
    assert [(r["step"], r["val_loss_step"]) for r in logged if "val_loss_step" in r] == [
        (i, pytest.approx(v, abs=1e-6)) for i, v in enumerate(batch_values)
    ]
    assert [r["step"] for r in logged if "val_loss_epoch" in r] == [3, 6]
    assert trainer.logged_metrics["val_loss_step"] == pytest.approx(batch_values[-1], abs=1e-6)
    assert "val_loss_step" not in trainer.callback_metrics  # it keeps the epoch's value, as Lightning's
    assert trainer.callback_metrics["val_loss"] == trainer.callback_metrics["val_loss_epoch"]


def test_the_values_of_steps_that_write_no_row_are_read_from_the_device_only_when_asked(
    tmp_path, monkeypatch
):
    """Keeping each step's values for callback_metrics costs no host sync per step (a GPU would stall):
    they are read when callback_metrics or logged_metrics is."""
    reads = []
    for name in ("__float__", "item"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, _real=real: reads.append(1) or _real(t))

    def fit_reads(module: TrainModule) -> int:
        reads.clear()
        Trainer(
            max_steps=20, default_root_dir=tmp_path / str(id(module)), **quiet(log_every_n_steps=1000)
        ).fit(module, DataLoader(regression_data(80), batch_size=4))
        return len(reads)

    class Silent(LitClassifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

    silent, logging = fit_reads(Silent()), fit_reads(Logs(on_step=True))
    assert logging - silent <= 2  # the last step's row and its read; not one a step


def test_the_epoch_s_value_is_the_bare_name_s_after_steps_that_wrote_no_row(tmp_path):
    module = LitClassifier()  # train_loss per step and per epoch, 3 steps an epoch
    trainer = Trainer(max_epochs=2, default_root_dir=tmp_path, **quiet(log_every_n_steps=4))
    trainer.fit(module, DataLoader(regression_data(40), batch_size=16))
    # the last step (6) wrote no row; its value was read after the epoch's, which still wins under the bare name
    assert trainer.callback_metrics["train_loss_step"] == pytest.approx(module.step_values[-1][0], abs=1e-6)
    assert trainer.callback_metrics["train_loss"] == trainer.callback_metrics["train_loss_epoch"]
    assert trainer.logged_metrics["train_loss_step"] == trainer.callback_metrics["train_loss_step"]


def test_what_on_train_batch_end_logs_reaches_callback_metrics_at_steps_that_write_no_row(tmp_path):
    class BatchEnd(LitClassifier):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.log("batch_end_loss", outputs["loss"])

    module = BatchEnd()
    trainer = Trainer(max_epochs=2, default_root_dir=tmp_path, **quiet(log_every_n_steps=4))
    trainer.fit(module, DataLoader(regression_data(40), batch_size=16))
    # the last step (6) wrote no row: its value is in callback_metrics and logged_metrics, not in the log
    assert trainer.callback_metrics["batch_end_loss"] == pytest.approx(module.step_values[-1][0], abs=1e-6)
    assert trainer.logged_metrics["batch_end_loss"] == trainer.callback_metrics["batch_end_loss"]
    assert [r["step"] for r in rows(tmp_path) if "batch_end_loss" in r] == [4]
