"""A Lightning-style module under DDP on self-spawned CPU processes (`python lightning_script.py OUT --devices 2`):
rank 1's training_step returns None at batch 1, and every step logs its rank with and without
sync_dist. Rank 0 writes OUT/result.json; the metrics are in OUT/logs, and in a CSVLogger's version_1
(OUT/csv/lightning_logs/version_0 is an earlier run's), whose `log_dir` every rank reports."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer import Trainer, TrainModule
from trainer.loggers import CSVLogger


class LitModel(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        self.log("rank_synced", float(self.global_rank), sync_dist=True)
        self.log("rank_local", float(self.global_rank))
        if batch_idx == 1 and self.global_rank == 1:
            return None
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--devices", type=int, required=True)
    a = p.parse_args()
    out = a.out
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    earlier = out / "csv" / "lightning_logs" / "version_0"
    earlier.mkdir(parents=True, exist_ok=True)
    (earlier / "metrics.csv").write_text("step\n")
    trainer = Trainer(
        strategy="ddp", devices=a.devices, max_steps=3, seed=0, default_root_dir=out,
        enable_progress_bar=False, log_every_n_steps=1, logger=CSVLogger(out / "csv"),
    )  # fmt: skip
    module = LitModel()
    trainer.fit(module, DataLoader(data, batch_size=16))
    weights = torch.cat([p.detach().flatten() for p in module.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(a.devices)]
    dist.all_gather(gathered, weights)
    log_dirs = [None, None]
    dist.all_gather_object(log_dirs, trainer.logger.log_dir)
    if trainer.is_global_zero:
        result = {
            "skipped_steps": trainer.state.skipped_steps,
            "global_step": trainer.global_step,
            "weights_equal_across_ranks": bool(torch.equal(gathered[0], gathered[1])),
            "log_dirs": log_dirs,
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
