"""Tokens/s of the tiny recipe's Llama through `Trainer` vs a hand-written loop, same invocation.

Same model (recipes/llama_tiny.yaml's shape), same data loader, AdamW, clipping 1.0, cosine schedule;
the Trainer also logs every 10 steps and draws its progress bar. Target: Trainer / hand >= 0.97.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import compare, fit_timed  # noqa: E402

from trainer.config import build_llama_config, load_recipe  # noqa: E402
from trainer.core.schedules import LRSchedule, build_scheduler  # noqa: E402
from trainer.data import lm_dataloaders  # noqa: E402
from trainer.models.causal_lm import CausalLM  # noqa: E402
from trainer.models.llama import Llama  # noqa: E402

RECIPE = load_recipe(Path(__file__).parents[1] / "recipes" / "llama_tiny.yaml")
CONFIG = build_llama_config(RECIPE["model"])
DATA = RECIPE["data"]
STEPS = 25


def loader():
    return lm_dataloaders(None, seq_len=DATA["seq_len"], batch_size=DATA["batch_size"])[0]


def hand_loop() -> list[float]:
    import time

    model = Llama(CONFIG)
    module = CausalLM(model)  # only for its optimizer grouping, so both sides optimise identically
    opt = module.configure_optimizers()
    sched = build_scheduler(opt, LRSchedule("cosine", 5, STEPS))
    stamps = []
    for step, batch in enumerate(loader()):
        logits = model(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if (step + 1) % 10 == 0:
            loss.item()
        stamps.append(time.perf_counter())
        if step + 1 == STEPS:
            break
    return stamps


def with_trainer(clock, root: str) -> None:
    fit_timed(CausalLM(CONFIG), loader(), clock, root, STEPS, warmup=5)


if __name__ == "__main__":
    hand, ours = compare(hand_loop, with_trainer, rounds=3, skip=3)
    tokens = DATA["seq_len"] * DATA["batch_size"]
    print(
        f"tiny Llama ({CONFIG.dim}x{CONFIG.n_layers}), {DATA['batch_size']} x {DATA['seq_len']} tokens/step, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"  hand-written loop: {tokens / hand:8.0f} tokens/s")
    print(f"  Trainer:           {tokens / ours:8.0f} tokens/s")
    print(f"  ratio Trainer/hand: {hand / ours:.3f}  (target >= 0.97)")
