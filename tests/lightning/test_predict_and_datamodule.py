"""`Trainer.predict` with `predict_step`, and Lightning's `datamodule=` (and a module's own
`*_dataloader` methods) supplying the loaders of fit, validate, test and predict."""

from __future__ import annotations

import pytest
import torch
from helpers import quiet, read_metrics, regression_data
from torch import nn
from torch.utils.data import DataLoader

from trainer import Trainer, TrainModule


class LitRegressor(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RegressionData:
    """A LightningDataModule-shaped object (no base class needed): setup(stage) and the loaders."""

    def __init__(self, batch_size=16):
        self.batch_size, self.stages = batch_size, []

    def setup(self, stage):
        self.stages.append(stage)
        self.train, self.val, self.test = (
            regression_data(64),
            regression_data(32, seed=1),
            regression_data(32, seed=2),
        )

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.test, batch_size=self.batch_size)


def test_predict_returns_each_batchs_predict_step_output_in_order(tmp_path):
    module, data = LitRegressor(), regression_data(40)
    predictions = Trainer(default_root_dir=tmp_path, **quiet()).predict(
        module, DataLoader(data, batch_size=16)
    )
    assert [p.shape for p in predictions] == [(16, 1), (16, 1), (8, 1)]
    with torch.no_grad():
        assert torch.allclose(torch.cat(predictions), module(data.tensors[0]))


def test_predict_default_step_calls_forward_and_limit_predict_batches_stops_early(tmp_path):
    class Plain(LitRegressor):
        predict_step = TrainModule.predict_step

    x = torch.randn(48, 8)
    trainer = Trainer(default_root_dir=tmp_path, limit_predict_batches=2, **quiet())
    predictions = trainer.predict(Plain(), DataLoader(x, batch_size=16))
    assert len(predictions) == 2 and predictions[0].shape == (16, 1)


def test_a_datamodule_supplies_fit_validate_test_and_predict(tmp_path):
    data, module = RegressionData(), LitRegressor()
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, **quiet())
    trainer.fit(module, datamodule=data)
    assert read_metrics(tmp_path, "val_loss"), "the datamodule's val_dataloader was used"
    assert "test_loss" in trainer.test(module, datamodule=data)
    assert "val_loss" in trainer.validate(module, datamodule=data)
    assert len(trainer.predict(module, datamodule=data)) == 2
    assert data.stages == ["fit", "test", "validate", "predict"]


def test_a_module_with_its_own_dataloaders_fits_without_any_passed(tmp_path):
    class SelfContained(LitRegressor):
        def train_dataloader(self):
            return DataLoader(regression_data(32), batch_size=16)

        def val_dataloader(self):
            return DataLoader(regression_data(16), batch_size=16)

    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, **quiet())
    trainer.fit(SelfContained())
    assert trainer.global_step == 2 and read_metrics(tmp_path, "val_loss")


def test_test_uses_limit_test_batches_not_the_validation_limit(tmp_path):
    seen = []

    class Counts(LitRegressor):
        def test_step(self, batch, batch_idx):
            seen.append(batch_idx)

    Trainer(default_root_dir=tmp_path, limit_val_batches=1, limit_test_batches=3, **quiet()).test(
        Counts(), DataLoader(regression_data(80), batch_size=16)
    )
    assert seen == [0, 1, 2]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda t, m, d: t.fit(m, DataLoader(regression_data(16)), datamodule=d), r"fit got both dataloaders and a datamodule"),
        (lambda t, m, d: t.fit(m, datamodule=object()), r"datamodule object has no train_dataloader\(\), which fit needs"),
        (lambda t, m, d: t.predict(m), r"predict needs dataloaders or a datamodule; got neither"),
    ],
)  # fmt: skip
def test_a_datamodule_mixed_with_loaders_or_missing_a_loader_is_refused(tmp_path, call, match):
    trainer = Trainer(max_steps=1, default_root_dir=tmp_path, **quiet())
    with pytest.raises((ValueError, TypeError), match=match):
        call(trainer, LitRegressor(), RegressionData())


def test_prepare_data_runs_before_setup_and_teardown_after_each_stage(tmp_path):
    from trainer import DataModule

    calls = []

    class Files(DataModule):
        def prepare_data(self):
            calls.append("prepare_data")
            torch.save(regression_data(32).tensors, tmp_path / "data.pt")  # as a download would

        def setup(self, stage):
            calls.append(f"setup:{stage}")
            self.data = torch.utils.data.TensorDataset(*torch.load(tmp_path / "data.pt"))

        def train_dataloader(self):
            return DataLoader(self.data, batch_size=16)

        def teardown(self, stage):
            calls.append(f"teardown:{stage}")

    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(LitRegressor(), datamodule=Files())
    assert calls == ["prepare_data", "setup:fit", "teardown:fit"]
