"""An epoch mean logged without `batch_size` weighs each batch by its size, inferred from the batch as
PyTorch Lightning infers it: a last batch smaller than the others counts for its examples only. Run side
by side with Lightning on the same module (10 examples in batches of 4, 4 and 2)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainer import Trainer, TrainModule
from trainer.core.batch_size import infer_batch_size

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


class Pairs(Dataset):
    """10 examples; as dicts when `as_dict` (the batch is then {"x": ..., "y": ...})."""

    def __init__(self, as_dict: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(10, 3, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.as_dict = as_dict

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": self.y[i]} if self.as_dict else (self.x[i], self.y[i])


def module(base: type) -> type:
    class Logs(base):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(3, 1)

        def _loss(self, batch):
            x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
            return nn.functional.mse_loss(self(x), y)

        def forward(self, x):
            return self.layer(x)

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            self.log("train_sum", loss, on_epoch=True, reduce_fx="sum")
            self.log("train_given", loss, on_epoch=True, batch_size=1)  # given: every batch weighs 1
            return loss

        def on_train_epoch_end(self):  # outside a batch: weighs 1
            self.log("epoch_end", float(self.current_epoch))

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch))
            self.log("val_max", self._loss(batch), reduce_fx="max")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Logs


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_epoch_means_weigh_each_batch_by_its_inferred_size_as_lightnings(tmp_path, as_dict):
    seen = {}
    for name, trainer, model in (
        (
            "lightning",
            pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, **QUIET),
            module(pl.LightningModule)(),
        ),
        ("ours", Trainer(max_epochs=2, **QUIET), module(TrainModule)()),
    ):
        loaders = [DataLoader(Pairs(as_dict), batch_size=4) for _ in range(2)]
        trainer.fit(model, *loaders)
        seen[name] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    lightning, ours = seen["lightning"], seen["ours"]
    for key in ("train_loss_epoch", "train_sum", "train_given", "epoch_end", "val_loss", "val_max"):
        assert ours[key] == pytest.approx(lightning[key], rel=1e-6, abs=1e-7), key
    # the sizes mattered: the plain mean over the three batches differs from the weighted one
    assert ours["train_given"] != pytest.approx(ours["train_loss_epoch"], rel=1e-3)


def test_a_batch_without_a_tensor_names_the_metric_and_the_way_out():
    with pytest.raises(ValueError, match=r"log\('acc'\) could not infer the batch size .* batch_size=N"):
        infer_batch_size({"text": ["a", "b"]}, "acc")
    assert infer_batch_size((torch.zeros(5, 2), torch.zeros(5)), "x") == (5, False)
    assert infer_batch_size({"ids": torch.zeros(3, 7), "mask": torch.zeros(4)}, "x") == (3, True)
    assert infer_batch_size(torch.tensor(2.0), "x") == (1, False)
