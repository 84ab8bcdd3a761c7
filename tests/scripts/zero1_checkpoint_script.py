"""A ZeRO-1 run of a wide MLP (its AdamW state dominates each process's memory) under torchrun: saves a
checkpoint at each step of --save-at and records each rank's peak RSS just before and just after each
save; or resumes from the newest good checkpoint under --root. Rank 0 writes the peaks to --out; the
losses go to the JSONL log."""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback
from strategies import FSDPStrategy
from trainer import Trainer, TrainModule

WIDTH, DEPTH, GLOBAL_BATCH = 2048, 8, 16


class WideMLP(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        layers = [m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
        self.net = nn.Sequential(*layers, nn.Linear(WIDTH, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class SaveAndMeasure(Callback):
    """At each step of `at`: the peak RSS so far (the steady state: training steps included), then a save,
    then the peak again. ru_maxrss is the process's high-water mark: only the save itself can raise it."""

    def __init__(self, at: list[int]) -> None:
        self.at, self.peaks = at, {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step in self.at:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            trainer.save_checkpoint()
            self.peaks[trainer.global_step] = (before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-at", default="2,4")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(GLOBAL_BATCH * a.steps, WIDTH, generator=g),
        torch.randn(GLOBAL_BATCH * a.steps, 1, generator=g),
    )
    trainer = Trainer(strategy=FSDPStrategy(zero_stage=1), max_steps=a.steps, default_root_dir=a.root,
                      enable_progress_bar=False, enable_checkpointing=False, log_every_n_steps=1,
                      callbacks=[] if a.resume else [saver := SaveAndMeasure([int(s) for s in a.save_at.split(",")])])  # fmt: skip
    world = trainer.strategy.world_size
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // world)
    trainer.fit(WideMLP(), loader, ckpt_path="last" if a.resume else None)
    peaks = trainer.strategy.all_gather_object({} if a.resume else saver.peaks)
    if trainer.is_global_zero:
        Path(a.out).write_text(json.dumps({"peaks": peaks, "world": world}))


if __name__ == "__main__":
    main()
