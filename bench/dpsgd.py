"""DP-SGD's cost against Opacus 1.6: step time and peak memory of private training of the same model on the
same batches, sigma = 1, C = 1, SGD, no Poisson sampling (the same batch size every step, so the work per
step is equal), at each batch size asked.

The model is a text classifier (embedding 512 x 128, two pre-norm MLP blocks 128 -> 512 -> 128, mean pool,
4 classes) over 32 tokens. Arms: plain training (the Trainer, no privacy), this project's DPSGDStrategy in
each grad_sample_mode (through the Trainer), and Opacus's PrivacyEngine in its "hooks" and "ghost" modes (a
hand-written loop, the way its tutorials train). Each arm runs in a fresh child process; the arms are
interleaved, round after round, and each arm's best round counts. Memory is the peak of the tensors that
training allocates, model and optimizer included: `torch.cuda.max_memory_allocated` over the level before
it on a GPU; on the CPU the peak of torch's tracked allocations over the first two steps (the profiler's
`profile_memory`, trainer/core/memory_peak.py; the second step holds whatever the first kept), which is the
same in every run, so one run per arm measures it (its own: the profiler's records take memory and time).
On the CPU the process's peak RSS over its RSS before training is printed too, best and median round: it
also holds what the allocators keep, which varies by about 10% from run to run (and our arms keep freed
heap memory for the next step on purpose: trainer/core/host_memory.py). Printed: ms/step, the
ratio to plain training, and ours/Opacus for time and tensor memory per mode ("mixed", our default,
against Opacus ghost).
Time is the median step's wall time and its process CPU time (one thread per arm by default: on a shared
machine the CPU time is what the step itself costs).
`python bench/dpsgd.py [--batch 64 256] [--rounds 5] [--threads 1]`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from callbacks import Callback  # noqa: E402
from trainer import Trainer, TrainModule  # noqa: E402
from trainer.core.memory_peak import PeakBytes  # noqa: E402

TRACKED = 2  # steps of a tracked run (CPU): the second holds whatever the first kept
STEPS, WARMUP, SEQ, VOCAB, DIM, HIDDEN, CLASSES = 10, 3, 32, 512, 128, 512, 4
OURS, OPACUS = ("hooks", "ghost", "mixed"), ("opacus-hooks", "opacus-ghost")
ARMS = ("plain", *OURS, *OPACUS)
PEER = {"hooks": "opacus-hooks", "ghost": "opacus-ghost", "mixed": "opacus-ghost"}


class Clock(Callback):
    """(wall, process CPU) seconds at the end of every optimizer step. With one thread per arm, CPU time
    is what the step costs even when other work shares the cores (wall time then includes the waits).
    `tracking` (memory tracking open since before the model was built, if any) ends after TRACKED steps."""

    def __init__(self, tracking: contextlib.ExitStack) -> None:
        self.stamps: list[tuple[float, float]] = []
        self.tracking = tracking

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.tick()

    def tick(self) -> None:
        self.stamps.append((time.perf_counter(), time.process_time()))
        if len(self.stamps) == TRACKED:
            self.tracking.close()


class Block(nn.Module):
    """Pre-norm MLP block with a residual: x + W2 gelu(W1 LN(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TextClassifier(nn.Module):
    """Tokens (B, T) -> class logits (B, 4), mean-pooled over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))).mean(1))


class Classify(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = TextClassifier()

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        return F.cross_entropy(self.net(tokens), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def dataset(batch: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = batch * (STEPS + 1)
    return TensorDataset(
        torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    )


def run(arm: str, batch: int, track: bool) -> dict[str, float]:
    """One arm's run: with `track`, TRACKED steps and the peak MiB of its tensors (`tensor_mib`); else its
    median step time (wall and CPU) after the warm-up steps and its training memory in MiB: tensors on a
    GPU, resident on the CPU (`rss_mib`)."""
    import opacus  # noqa: F401  both libraries loaded before the baseline, in every arm

    import strategies.dp_sgd  # noqa: F401

    torch.manual_seed(0)
    data, on_gpu = dataset(batch), torch.cuda.is_available()
    before = _memory_mib(on_gpu)
    tracked, tracking = PeakBytes(), contextlib.ExitStack()
    if track and not on_gpu:  # (a GPU counts its tensors' peak itself)
        tracking.enter_context(tracked.track())
    clock = Clock(tracking)
    (run_opacus if arm in OPACUS else run_ours)(arm, data, batch, clock, TRACKED if track else STEPS)
    tensors = {
        "tensor_mib": torch.cuda.max_memory_allocated() / 2**20 - before if on_gpu else tracked.peak / 2**20
    }
    if track:
        return tensors
    pairs = list(zip(clock.stamps[WARMUP:], clock.stamps[WARMUP + 1 :], strict=False))
    times = {
        "step_s": statistics.median(b[0] - a[0] for a, b in pairs),
        "cpu_s": statistics.median(b[1] - a[1] for a, b in pairs),
    }
    if on_gpu:
        return {**times, **tensors}
    return {**times, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before}


def run_ours(arm: str, data: TensorDataset, batch: int, clock: Clock, steps: int) -> None:
    """`steps` of plain training or DPSGDStrategy in mode `arm`, through the Trainer."""
    from strategies.dp_sgd import DPSGDStrategy

    strategy = "auto"
    if arm != "plain":
        strategy = DPSGDStrategy(
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode=arm,
            noise_seed=0,
        )
    with tempfile.TemporaryDirectory() as root:
        Trainer(
            strategy=strategy, accelerator="gpu" if torch.cuda.is_available() else "cpu", max_steps=steps,
            enable_progress_bar=False, enable_checkpointing=False, callbacks=[clock], default_root_dir=root,
            log_every_n_steps=steps,
        ).fit(Classify(), DataLoader(data, batch_size=batch))  # fmt: skip


def run_opacus(arm: str, data: TensorDataset, batch: int, clock: Clock, steps: int) -> None:
    """`steps` of Opacus's PrivacyEngine in its "hooks" or "ghost" mode, in the loop of its tutorials."""
    from opacus import PrivacyEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TextClassifier().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mode = arm.removeprefix("opacus-")
    private = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=mode,
    )  # fmt: skip
    if mode == "ghost":  # ghost mode wraps the loss: its backward runs the second, clipped backward
        model, optimizer, criterion, loader = private
    else:
        (model, optimizer, loader), criterion = private, nn.CrossEntropyLoss()
    for step, (tokens, labels) in enumerate(loader):
        if step == steps:
            break
        optimizer.zero_grad()
        criterion(model(tokens.to(device)), labels.to(device)).backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        clock.tick()


def _memory_mib(on_gpu: bool) -> float:
    """What the process holds now: allocated GPU memory (the peak counter reset), or resident memory."""
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    # the peak RSS varies from one fresh process to the next (batch 256: +-10%, in every arm): 5 rounds give
    # its median as well as its best
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per arm (the arms run one at a time)"
    )
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # a child process: one arm, one batch
    parser.add_argument("--track", action="store_true", help=argparse.SUPPRESS)  # ... its tracked tensors
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.arm:
        print(json.dumps(run(args.arm, args.batch[0], args.track)))
        return

    def child(arm: str, batch: int, *flags: str) -> dict[str, float]:
        out = subprocess.run(
            [sys.executable, __file__, "--arm", arm, "--batch", str(batch), "--threads", str(args.threads), *flags],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    rounds: dict[tuple[int, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for batch in args.batch:
            for arm in ARMS:
                rounds.setdefault((batch, arm), []).append(child(arm, batch))
    if not torch.cuda.is_available():  # the tensors' peak, in runs of their own
        for (batch, arm), xs in rounds.items():
            tensors = child(arm, batch, "--track")
            for x in xs:
                x.update(tensors)
    print(
        f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores"
    )
    for batch in args.batch:
        report(batch, {arm: rounds[batch, arm] for arm in ARMS})


def report(batch: int, rounds: dict[str, list[dict[str, float]]]) -> None:
    """One batch size's table: each arm's best round of wall and CPU time, its tensors' peak memory (and on
    the CPU its peak RSS, best and median round, since a process's resident peak varies from run to run),
    against plain training, and ours against Opacus (on a shared machine the CPU-time ratio is the one to
    read)."""
    r = {arm: {k: min(x[k] for x in xs) for k in xs[0]} for arm, xs in rounds.items()}
    plain = r["plain"]
    n = len(rounds["plain"])
    rss = "rss_mib" in plain
    print(
        f"text classifier, batch {batch} x {SEQ} tokens, sigma 1, C 1, SGD (best of {n} rounds; memory: tensors"
        + ("; RSS best, median):" if rss else "):")
    )
    for arm, x in r.items():
        line = (
            f"  {arm:12s} wall {x['step_s'] * 1e3:7.1f} ms/step, cpu {x['cpu_s'] * 1e3:7.1f} ms/step "
            f"({x['cpu_s'] / plain['cpu_s']:.2f}x plain), tensors {x['tensor_mib']:5.1f} MiB"
        )
        if rss:
            line += (
                f", RSS {x['rss_mib']:4.0f}, {statistics.median(y['rss_mib'] for y in rounds[arm]):4.0f} MiB"
            )
        if arm in PEER:
            peer = r[PEER[arm]]
            line += (
                f"  | vs {PEER[arm]}: wall {x['step_s'] / peer['step_s']:.2f}x, cpu {x['cpu_s'] / peer['cpu_s']:.2f}x, "
                f"tensors {x['tensor_mib'] / max(peer['tensor_mib'], 1e-9):.2f}x"
            )
        print(line)


if __name__ == "__main__":
    main()
