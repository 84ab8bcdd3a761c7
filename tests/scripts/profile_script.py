"""A profiled training run the profiler tests start as a user would: `python tests/scripts/profile_script.py
--devices 2 --root DIR` self-spawns DDP ranks (gloo on the CPU) that train a tiny Llama under the Profiler
and the ThroughputMonitor."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import LLAMA, token_loader  # noqa: E402

from callbacks.profiler import Profiler
from callbacks.throughput import ThroughputMonitor
from trainer import Trainer
from trainer.models.causal_lm import CausalLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--root", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    trainer = Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=a.devices,
        max_steps=a.steps,
        seed=0,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=a.root,
        callbacks=[Profiler(wait=1, warmup=1, active=2), ThroughputMonitor()],
    )
    trainer.fit(CausalLM(LLAMA, lr=1e-2), token_loader(a.micro_batch))


if __name__ == "__main__":
    main()
