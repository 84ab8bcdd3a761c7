"""What the per-step watchers cost: the tiny recipe's Llama through the Trainer with and without NaNGuard,
Timer, StragglerDetector and ThroughputMonitor, alternately in one process (best of ROUNDS medians).

NaNGuard reads the loss and gradient norm back every step (a device sync and, with several ranks, one
all-reduce); Timer and the others are cheaper. Ratio = with / without.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import StepClock, seconds_per_step  # noqa: E402

from callbacks import NaNGuard, StragglerDetector, ThroughputMonitor, Timer  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.config import build_llama_config, load_recipe  # noqa: E402
from trainer.data import lm_dataloaders  # noqa: E402
from trainer.models.causal_lm import CausalLM  # noqa: E402

RECIPE = load_recipe(Path(__file__).parents[1] / "recipes" / "llama_tiny.yaml")
STEPS, SKIP, ROUNDS = 25, 5, 3


def run(watchers: bool) -> float:
    data = RECIPE["data"]
    loader = lm_dataloaders(None, seq_len=data["seq_len"], batch_size=data["batch_size"])[0]
    clock = StepClock()
    extra = [NaNGuard(spike_factor=3.0), Timer(), StragglerDetector(every_n_steps=10), ThroughputMonitor()]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        Trainer(
            max_steps=STEPS,
            gradient_clip_val=1.0,
            enable_progress_bar=False,
            enable_checkpointing=False,
            callbacks=[clock, *(extra if watchers else [])],
            default_root_dir=root,
        ).fit(CausalLM(build_llama_config(RECIPE["model"])), loader)
    return seconds_per_step(clock.stamps, SKIP)


def main() -> None:
    torch.set_num_threads(2)
    plain, watched = [], []
    for _ in range(ROUNDS):
        plain.append(run(False))
        watched.append(run(True))
    print(f"tiny Llama, {STEPS} steps, best of {ROUNDS} alternating rounds")
    print(f"  Trainer:                          {min(plain) * 1e3:.1f} ms/step")
    print(f"  + NaNGuard/Timer/Straggler/Throughput: {min(watched) * 1e3:.1f} ms/step")
    print(f"  ratio with / without: {min(watched) / min(plain):.3f}")


if __name__ == "__main__":
    main()
