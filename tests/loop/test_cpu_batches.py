"""On the CPU, training_step gets each batch as the loader yielded it: not copied, whatever its type."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from helpers import Regression, quiet, regression_data
from torch.utils.data import DataLoader

from trainer import Trainer


@dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    y: torch.Tensor


def collate(samples):
    return Batch(torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]))


class Recording(DataLoader):
    """Remembers every batch it yields."""

    yielded: list

    def __iter__(self):
        self.yielded = []
        for batch in super().__iter__():
            self.yielded.append(batch)
            yield batch


class OnFrozenBatches(Regression):
    def __init__(self):
        super().__init__()
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch)
        return torch.nn.functional.mse_loss(self(batch.x), batch.y)


def test_a_frozen_dataclass_batch_reaches_training_step_as_yielded(tmp_path):
    loader = Recording(regression_data(64), batch_size=16, collate_fn=collate)
    module = OnFrozenBatches()
    Trainer(max_steps=3, default_root_dir=tmp_path, enable_checkpointing=False, **quiet()).fit(module, loader)
    assert len(module.seen) == 3
    assert all(got is yielded for got, yielded in zip(module.seen, loader.yielded, strict=False))
