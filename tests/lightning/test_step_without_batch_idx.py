"""Steps written without `batch_idx`, as Lightning's GAN example writes `training_step(self, batch)`: Lightning
calls them with the batch alone, and so does this Trainer (issue 52)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import trainer


class Body:
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def predict_step(self, batch):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Lit(Body, pl.LightningModule):
    pass


class Ours(Body, trainer.TrainModule):
    pass


def run(make, Trainer, tmp_path, **extra):
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    module = make()
    t = Trainer(
        max_epochs=2, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu", **extra,
    )  # fmt: skip
    t.fit(module, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    val_loss = float(t.callback_metrics["val_loss"])
    predictions = t.predict(module, DataLoader(data, batch_size=8))
    return module.net.weight.detach().clone(), torch.cat(predictions), val_loss


def test_steps_without_batch_idx_train_validate_and_predict_as_under_lightning(tmp_path):
    weight, predictions, val_loss = run(Ours, trainer.Trainer, tmp_path / "ours")
    their_weight, their_predictions, their_val_loss = run(Lit, pl.Trainer, tmp_path / "lit", devices=1)
    torch.testing.assert_close(weight, their_weight, rtol=0, atol=1e-7)
    torch.testing.assert_close(predictions, their_predictions, rtol=0, atol=1e-7)
    assert abs(val_loss - their_val_loss) < 1e-6
