"""Trainer overhead: a small MLP trained by a hand-written PyTorch loop and by `Trainer`, same invocation.

Both do the same work per step: forward, backward, global-norm clipping, AdamW, cosine schedule, and
reading the loss every 10 steps; the Trainer also logs to JSONL and draws its progress bar. The two run
interleaved in one process: each Trainer step's batch-end hook runs one step of the hand loop, timed
apart, so other work on a shared machine slows both alike. Their ratio is paired: Trainer time / hand
time over the same window of 10 steps (one logged step of each), median over windows, then over rounds.

Prints both step times and the ratio (target: Trainer / hand loop <= 1.05), for this MLP and a 3-layer one
whose hand step takes issue 52's "~1.2 ms" on this machine; the extra time per step for an 8-wide MLP
whose compute is nearly nil, which shows the Trainer's absolute per-step cost in microseconds; then the
Trainer's fixed cost per fit: building it, from calling `fit` to the first step (less that step's batch
fetch) and from the last step to `fit` returning, next to the hand loop's own set-up (optimizer,
schedule, loader iterator).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from common import Interleaved, build_trainer  # noqa: E402

from trainer import TrainModule  # noqa: E402
from trainer.core.schedules import LRSchedule, build_scheduler  # noqa: E402

STEPS, BATCH, ROUNDS, SKIP, WINDOW = 300, 64, 9, 20, 10  # WINDOW: the logging interval of both loops


def make_net(width: int, layers: int = 2) -> torch.nn.Module:
    """`layers` linear layers, `width` -> 4 x `width` (-> 4 x `width` ...) -> `width`, GELU between them."""
    hidden = [torch.nn.Linear(4 * width, 4 * width) for _ in range(layers - 2)]
    inner = [m for layer in hidden for m in (layer, torch.nn.GELU())]
    return torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), *inner, torch.nn.Linear(4 * width, width)
    )


def data(width: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, width, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=BATCH)


class HandLoop:
    """The hand-written loop, one step per `step()`. Building it times its set-up (`setup_s`): the
    optimizer, the schedule and the loader's iterator (the model and the loader are built before, as the
    Trainer gets them)."""

    def __init__(self, net: torch.nn.Module, loader: DataLoader) -> None:
        started = time.perf_counter()
        self.net = net
        self.opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        self.sched = build_scheduler(self.opt, LRSchedule("cosine", 10, STEPS))
        self.batches = iter(loader)
        self.setup_s = time.perf_counter() - started
        self.steps = 0

    def step(self) -> None:
        x, y = next(self.batches)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.steps += 1
        if self.steps % 10 == 0:
            loss.item()


class MLP(TrainModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = make_net(width, layers)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def one_round(width: int, layers: int) -> dict[str, float]:
    """One fit of the Trainer with the hand loop interleaved; the seconds this round measured."""
    torch.manual_seed(0)  # the same initial weights on both sides
    hand = HandLoop(make_net(width, layers), data(width))
    clock = Interleaved(hand.step)
    torch.manual_seed(0)
    module, loader = MLP(width, layers), data(width)
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        trainer = build_trainer(clock, root, STEPS, warmup=10)
        clock.called_at = time.perf_counter()
        trainer.fit(module, loader)
        returned = time.perf_counter()
    windows = clock.windows(SKIP, WINDOW)
    return {
        "ratio": statistics.median(ours / theirs for ours, theirs in windows),
        "extra": statistics.median((ours - theirs) / WINDOW for ours, theirs in windows),
        "hand": statistics.median(theirs for _, theirs in windows) / WINDOW,
        "trainer": statistics.median(ours for ours, _ in windows) / WINDOW,
        "build": clock.called_at - started,
        "startup": clock.startup_s,
        "teardown": returned - clock.last_step_end,
        "hand_setup": hand.setup_s,
    }


def rounds(width: int, layers: int = 2) -> list[dict[str, float]]:
    """ROUNDS fits, each with its own hand loop: what each measured (a round is disturbed as a whole when
    the machine is busy for seconds, so the medians are taken over rounds too)."""
    return [one_round(width, layers) for _ in range(ROUNDS)]


def print_ratio(title: str, results: list[dict[str, float]]) -> None:
    """Both loops' step times and their paired ratio, against issue 52's target."""
    ratios = sorted(r["ratio"] for r in results)
    print(title)
    print(f"  hand-written loop: {median_of(results, 'hand') * 1e3:.3f} ms/step")
    print(f"  Trainer:           {median_of(results, 'trainer') * 1e3:.3f} ms/step")
    print(
        f"  ratio Trainer/hand: {median_of(results, 'ratio'):.3f}  (rounds {ratios[0]:.3f}..{ratios[-1]:.3f}; "
        f"target <= 1.05), {median_of(results, 'extra') * 1e6:.0f} us/step more"
    )


def median_of(results: list[dict[str, float]], key: str) -> float:
    """The median over rounds of one measured quantity."""
    return statistics.median(r[key] for r in results)


if __name__ == "__main__":
    torch.set_num_threads(1)  # one thread: the least noisy clock on a shared machine; overhead is per step
    # torch's own one-time cost, which whichever loop builds the first optimizer would pay: it imports
    # torch._dynamo (about 1 s here)
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
    wide = rounds(256)
    print_ratio(
        f"MLP 256->1024->256, batch {BATCH}, 1 thread; {ROUNDS} rounds of {STEPS} steps, interleaved", wide
    )
    print_ratio('3-layer MLP 40->160->160->40 (issue 52\'s "~1.2 ms" arm)', rounds(40, layers=3))
    tiny = rounds(8)
    print(
        f"MLP 8->32->8 (almost no compute): Trainer costs {median_of(tiny, 'extra') * 1e6:.0f} us/step more "
        f"({median_of(tiny, 'hand') * 1e6:.0f} vs {median_of(tiny, 'trainer') * 1e6:.0f} us)"
    )
    later, first = wide[1:], wide[0]  # the first fit in a process also pays one-time costs (lazy imports)
    hand_setup = median_of(later, "hand_setup")
    print(f"Fixed cost per fit (MLP 256; median of rounds 2-{ROUNDS}, the process's first fit in brackets):")
    print(f"  Trainer(...):  {median_of(later, 'build') * 1e3:6.1f} ms  ({first['build'] * 1e3:.1f})")
    print(
        f"  fit start-up:  {median_of(later, 'startup') * 1e3:6.1f} ms  ({first['startup'] * 1e3:.1f}), "
        f"from calling fit to its first step, less that step's batch; the hand loop's set-up (optimizer, "
        f"schedule, loader): {hand_setup * 1e3:.2f} ms ({first['hand_setup'] * 1e3:.2f}), "
        f"ratio {median_of(later, 'startup') / hand_setup:.0f}"
    )
    print(
        f"  fit teardown:  {median_of(later, 'teardown') * 1e3:6.1f} ms  ({first['teardown'] * 1e3:.1f}), "
        "from the end of the last step to fit returning (the hand loop has none)"
    )
