"""Trainer overhead: a small MLP trained by a hand-written PyTorch loop and by `Trainer`, same invocation.

Both do the same work per step: forward, backward, global-norm clipping, AdamW, cosine schedule, and
reading the loss every 10 steps; the Trainer also logs to JSONL and draws its progress bar.
Prints both step times and the ratio (target: Trainer / hand loop <= 1.03), then the same for an
8-wide MLP whose compute is nearly nil, which shows the Trainer's absolute per-step cost in microseconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from common import compare, fit_timed  # noqa: E402

from trainer import TrainModule  # noqa: E402
from trainer.schedules import LRSchedule, build_scheduler  # noqa: E402

STEPS, BATCH, WIDTH = 300, 64, 256


def make_net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH)
    )


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, WIDTH, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=BATCH)


def hand_loop() -> list[float]:
    import time

    net = make_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sched = build_scheduler(opt, LRSchedule("cosine", 10, STEPS))
    stamps = []
    for step, (x, y) in enumerate(data()):
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if (step + 1) % 10 == 0:
            loss.item()
        stamps.append(time.perf_counter())
    return stamps


class MLP(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def with_trainer(clock, root: str) -> None:
    fit_timed(MLP(), data(), clock, root, STEPS, warmup=10)


if __name__ == "__main__":
    torch.set_num_threads(1)  # one thread: the least noisy clock on a shared machine; overhead is per step
    hand, ours = compare(hand_loop, with_trainer, rounds=7, skip=20)
    print(f"MLP {WIDTH}->{4 * WIDTH}->{WIDTH}, batch {BATCH}, 1 thread")
    print(f"  hand-written loop: {hand * 1e3:.3f} ms/step")
    print(f"  Trainer:           {ours * 1e3:.3f} ms/step")
    print(f"  ratio Trainer/hand: {ours / hand:.3f}  (target <= 1.03)")
    WIDTH = 8
    hand, ours = compare(hand_loop, with_trainer, rounds=7, skip=20)
    print(
        f"MLP 8->32->8 (almost no compute): Trainer costs {(ours - hand) * 1e6:.0f} us/step more "
        f"({hand * 1e6:.0f} vs {ours * 1e6:.0f} us)"
    )
