"""Runs each module of tests/scripts/user_steps.py under each of `--layouts` in turn on `--devices` processes,
as a user's script would (self-spawning): fit with validation, then a fresh `Trainer.validate`. Rank 0 writes
the final parameters and metrics of each to --out, by layout."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import regression_loader  # noqa: E402
from user_steps import FIT, GLOBAL_BATCH, MODULES  # noqa: E402

from strategies import DDPStrategy, FSDPStrategy  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.core.dtensors import full_value  # noqa: E402


def strategy(layout: str):
    """`ddp`, or `fsdpN` (ZeRO stage N) with `:full`/`:selective` activation checkpointing."""
    name, _, ac = layout.partition(":")
    if name == "ddp":
        return DDPStrategy()
    return FSDPStrategy(zero_stage=int(name[-1]), activation_checkpointing=ac or None)


def main() -> None:
    p = argparse.ArgumentParser()
    # each layout in turn in the same world: one launch pays the processes' start-up for all of them
    p.add_argument("--layouts", required=True)  # comma-separated: ddp, fsdp1, fsdp2, fsdp3, fsdp3:full
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    micro = GLOBAL_BATCH // a.devices
    results: dict[str, dict] = {}
    for layout in a.layouts.split(","):
        root = Path(a.root) / layout.replace(":", "-")
        results[layout] = {}
        for call, cls in MODULES.items():
            torch.manual_seed(0)
            module = cls()
            trainer = Trainer(
                strategy=strategy(layout), devices=a.devices, **FIT, default_root_dir=root / call
            )
            trainer.fit(
                module, regression_loader(batch_size=micro), regression_loader(batch_size=micro, n=64)
            )
            fit_metrics = dict(trainer.callback_metrics)
            params = [full_value(p).detach().flatten().tolist() for p in module.parameters()]
            torch.manual_seed(0)
            evaluator = Trainer(
                strategy=strategy(layout),
                devices=a.devices,
                enable_progress_bar=False,
                default_root_dir=root / f"{call}-validate",
            )
            validated = evaluator.validate(cls(), regression_loader(batch_size=micro, n=64))
            results[layout][call] = {
                "params": params,
                "fit_metrics": fit_metrics,
                "validate": validated,
                "training_steps": module.training_steps,
            }
    if trainer.is_global_zero:
        Path(a.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
