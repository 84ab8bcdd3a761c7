"""Runs each module of tests/scripts/user_steps.py under one strategy on `--devices` processes, as a user's
script would (self-spawning): fit with validation, then a fresh `Trainer.validate`. Rank 0 writes the
final parameters and metrics of each to --out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import regression_loader  # noqa: E402
from user_steps import FIT, GLOBAL_BATCH, MODULES  # noqa: E402

from strategies import DDPStrategy, FSDPStrategy  # noqa: E402
from trainer import Trainer  # noqa: E402


def strategy(name: str, ac: str | None):
    if name == "ddp":
        return DDPStrategy()
    return FSDPStrategy(zero_stage=int(name[-1]), activation_checkpointing=ac)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True)  # ddp, fsdp1, fsdp2, fsdp3
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--ac", default=None)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    micro = GLOBAL_BATCH // a.devices
    results = {}
    for call, cls in MODULES.items():
        torch.manual_seed(0)
        module = cls()
        trainer = Trainer(
            strategy=strategy(a.strategy, a.ac),
            devices=a.devices,
            **FIT,
            default_root_dir=Path(a.root) / call,
        )
        trainer.fit(module, regression_loader(batch_size=micro), regression_loader(batch_size=micro, n=64))
        fit_metrics = dict(trainer.callback_metrics)
        params = [
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().tolist()
            for p in module.parameters()
        ]
        torch.manual_seed(0)
        evaluator = Trainer(
            strategy=strategy(a.strategy, a.ac),
            devices=a.devices,
            enable_progress_bar=False,
            default_root_dir=Path(a.root) / f"{call}-validate",
        )
        validated = evaluator.validate(cls(), regression_loader(batch_size=micro, n=64))
        results[call] = {
            "params": params,
            "fit_metrics": fit_metrics,
            "validate": validated,
            "training_steps": module.training_steps,
        }
    if trainer.is_global_zero:
        Path(a.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
