"""Two of Lightning's Trainer arguments that show only under several processes, run one after the other as a
user's script runs them (`python trainer_arguments_script.py OUT --devices 2`, self-spawning):

- `sync_batchnorm=True` under DDP and FSDP: the BatchNorm layers' classes during the fit and after it, and
  the final parameters and running statistics (the same as one process's on the global batch), next to a
  plain DDP run's ("plain": each rank's BatchNorm sees its half of the batch);
- `use_distributed_sampler=False`: the samples each rank read (all of them, as given), next to the default's.

Every rank writes OUT/rank<R>.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer import Trainer, TrainModule
from trainer.core.dtensors import full_value

STEPS, PER_RANK_BATCH = 3, 4
FIT = {
    "max_steps": STEPS,
    "enable_progress_bar": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


def dataset(n: int = 32) -> TensorDataset:
    """Samples whose first feature is their index (so a batch says which samples it holds)."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.arange(n, dtype=torch.float32).unsqueeze(1) / n, torch.randn(n, 3, generator=g)], 1)
    return TensorDataset(x, torch.randn(n, 1, generator=g))


class BatchNormNet(TrainModule):
    """A BatchNorm between two layers, trained by SGD; records its layers' classes when training starts and
    the samples of every batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        self.classes_in_fit: list[str] = []
        self.seen: list[list[int]] = []

    def on_train_start(self) -> None:
        self.classes_in_fit = [type(m).__name__ for m in self.net]

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append([round(float(i) * len(dataset())) for i in x[:, 0]])
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def state(module: BatchNormNet) -> dict[str, list[float]]:
    """The parameters and buffers (running statistics) by name, flattened."""
    return {k: full_value(v).detach().float().flatten().tolist() for k, v in module.net.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--devices", type=int, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    record = {}
    runs = {
        "plain": {"strategy": "ddp"},
        "sync": {"strategy": "ddp", "sync_batchnorm": True},
        "sync_fsdp": {"strategy": "fsdp", "sync_batchnorm": True},
        "unsharded": {"strategy": "ddp", "use_distributed_sampler": False},
    }
    for name, flags in runs.items():
        module = BatchNormNet()
        trainer = Trainer(devices=a.devices, default_root_dir=a.out / name, **FIT, **flags)
        trainer.fit(module, DataLoader(dataset(), batch_size=PER_RANK_BATCH))
        record[name] = {
            "classes_in_fit": module.classes_in_fit,
            "classes_after": [type(m).__name__ for m in module.net],
            "state": state(module),
            "seen": module.seen,
        }
        rank = trainer.global_rank
    (a.out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
