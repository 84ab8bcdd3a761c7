"""A user's training script for the fault audit (copied into a case folder as fit.py): a small regressor
with a ModelCheckpoint every 2 steps, and the faults the audit asks for: the loss NaN from a step, a signal
sent to itself in a step, replica group 1 of `trainer replicas` dying in a step."""

import argparse
import os
import signal

import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import ModelCheckpoint
from trainer import Trainer, TrainModule
from trainer.fault_tolerance import FaultTolerance

GROUP = os.environ.get("REPLICA_GROUP_ID")  # set by `trainer replicas`


class Regressor(TrainModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.args = args

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        step = self.global_step + 1  # the optimizer step this batch makes
        if self.args.signal_at == step:
            os.kill(os.getpid(), getattr(signal, self.args.signal))
        if self.args.exit_at == step and GROUP == "1":
            os._exit(3)  # replica group 1 is lost
        if self.args.nan_from is not None and step >= self.args.nan_from:
            loss = loss * float("nan")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--nan-from", type=int, help="the loss is NaN from this step on")
    p.add_argument("--signal-at", type=int, help="the process sends itself --signal in this step")
    p.add_argument("--signal", default="SIGINT")
    p.add_argument("--exit-at", type=int, help="replica group 1 dies in this step")
    p.add_argument("--fault-tolerance", action="store_true", help="a replica group of `trainer replicas`")
    args = p.parse_args()
    ft = FaultTolerance.from_env(timeout_s=5, quorum_timeout_s=10) if args.fault_tolerance else None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    loader = DataLoader(TensorDataset(x, torch.tanh(x @ torch.randn(8, 1, generator=g))), batch_size=16)
    trainer = Trainer(
        max_steps=args.max_steps,
        default_root_dir=f"run/replica{GROUP}" if ft else "run",
        callbacks=[] if args.no_checkpointing else [ModelCheckpoint(every_n_steps=2, save_top_k=-1)],
        enable_checkpointing=not args.no_checkpointing,
        enable_progress_bar=False,
        fault_tolerance=ft,
        seed=0,
    )
    trainer.fit(Regressor(args), loader, loader, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
