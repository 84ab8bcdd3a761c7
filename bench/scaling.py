"""Data parallelism on 2 gloo processes (one thread each), two comparisons in one invocation:

- scaling: the tiny Llama recipe's tokens/s with 1 and 2 processes. Each process keeps its micro-batch
  (8 x 256 tokens), so ideal scaling doubles tokens/s; efficiency = tokens/s(2) / (2 x tokens/s(1)).
- peers (issue #32, "DDP at the limit"): a tiny Hugging Face `LlamaForCausalLM` (4 layers, dim 128, seq
  128, micro-batch 8 per process, AdamW, fp32, no clipping) trained three ways on the same random tokens:
  a hand-written loop on plain torch DDP (no framework), this project's Trainer (strategy "ddp") and
  PyTorch Lightning (strategy "ddp"). Every arm runs as its own 2-process job; the arms are interleaved
  round by round (in a rotated order), and each arm's tokens/s is the median over the rounds of the global
  tokens per step over rank 0's median step time after the warm-up; each ratio is also printed round by
  round, which cancels the host's slow drift. Targets: ours >= 0.98x the hand loop, >= Lightning.

    PYTHONPATH=. python bench/scaling.py                 # both
    PYTHONPATH=. python bench/scaling.py --only peers --rounds 3 --steps 40
    PYTHONPATH=. python bench/scaling.py --only peers --profile ours.prof   # cProfile of ours' rank 0

Needs transformers and Lightning (`lightning.pytorch` or `pytorch_lightning`); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RECIPE = Path(__file__).parents[1] / "recipes" / "llama_tiny.yaml"
STEPS = 40
WORLD, MICRO_BATCH, SEQ_LEN, LR = 2, 8, 128, 3e-4
ARMS = ("hand", "ours", "lightning")


# ---- scaling: the recipe on 1 and 2 processes ---------------------------------------------------------
def tokens_per_second(devices: int, root: Path) -> float:
    """Median global tokens/s over the logged steps after the first (start-up excluded)."""
    cmd = [
        sys.executable,
        "-m",
        "trainer.cli",
        "fit",
        str(RECIPE),
        f"trainer.devices={devices}",
        f"trainer.max_steps={STEPS}",
        "trainer.warmup_steps=2",
        "trainer.log_every_n_steps=5",
        "trainer.val_check_interval=1000",
        "trainer.val_at_start=false",
        "trainer.enable_progress_bar=false",
        "trainer.enable_checkpointing=false",
        "callbacks=[]",
        f"trainer.default_root_dir={root}",
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    rows = [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(
        r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r and r["step"] > 5
    )


def scaling() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        one = tokens_per_second(1, Path(tmp) / "one")
        two = tokens_per_second(2, Path(tmp) / "two")
    print(f"tiny Llama, 8 x 256 tokens per process per step, 1 thread per process, {os.cpu_count()} cores")
    print(f"  1 process : {one:8.0f} tokens/s")
    print(f"  2 processes (ddp): {two:8.0f} tokens/s")
    print(f"  speed-up {two / one:.2f}x, scaling efficiency {two / (2 * one):.2f}")


# ---- peers: what every arm shares -----------------------------------------------------------------------
def hf_llama() -> torch.nn.Module:
    """The tiny HF Llama, seeded: every arm starts from the same weights (DDP then broadcasts rank 0's)."""
    from transformers import LlamaForCausalLM

    from trainer.models.hf_llama import to_hf_config
    from trainer.models.llama import LlamaConfig

    config = to_hf_config(
        LlamaConfig.preset("tiny", dim=128, n_heads=4, n_kv_heads=2, max_seq_len=SEQ_LEN, vocab_size=512)
    )
    config._attn_implementation, config.use_cache = "sdpa", False
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def samples(steps: int) -> list[dict[str, torch.Tensor]]:
    """Random tokens (seed 0) for `steps` steps of every rank, {"input_ids", "labels"} with the labels
    already shifted (what HFModule trains on; the other arms compute the same loss)."""
    rows = torch.randint(
        512, (steps * WORLD * MICRO_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0)
    )
    return [{"input_ids": row[:-1], "labels": row[1:]} for row in rows]


def lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """HFModule's causal-LM loss: fp32 cross-entropy of the logits against the shifted labels."""
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


class Stamps:
    """Rank 0's wall-clock and CPU time (its process, every thread) at the end of every optimizer step;
    written to `path` as JSON at the end. CPU time is the work a step costs, which a loaded machine
    disturbs far less than wall-clock time."""

    def __init__(self, path: str) -> None:
        self.path, self.times = path, []

    def stamp(self) -> None:
        self.times.append((time.perf_counter(), time.process_time()))

    def write(self) -> None:
        Path(self.path).write_text(json.dumps(self.times))


# ---- the arms: each a 2-process job started by `--arm NAME --result PATH` -----------------------------
def run_hand(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:  # a FileStore: no port to pick
        mp.spawn(hand_rank, args=(str(Path(tmp) / "store"), args), nprocs=WORLD)


def hand_rank(rank: int, store: str, args: argparse.Namespace) -> None:
    """A plain DDP loop, as a user writes it: DDP's defaults, AdamW, each rank its own batches."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    model = DistributedDataParallel(hf_llama())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    stamps = Stamps(args.result)
    loader = DataLoader(samples(args.warmup + args.steps)[rank::WORLD], batch_size=MICRO_BATCH)
    for batch in loader:
        lm_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stamps.stamp()
    if rank == 0:
        stamps.write()
    dist.destroy_process_group()


def run_ours(args: argparse.Namespace) -> None:
    from torch.utils.data import DataLoader

    from callbacks import Callback
    from trainer import Trainer
    from trainer.models.hf import HFModule

    torch.set_num_threads(1)
    stamps = Stamps(args.result)

    class Clock(Callback):
        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            stamps.stamp()

    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=WORLD,
            max_steps=args.warmup + args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Clock()],
            default_root_dir=root,
        )
        module = HFModule(hf_llama(), task="causal-lm", lr=LR)
        loader = DataLoader(samples(args.warmup + args.steps), batch_size=MICRO_BATCH)
        if args.profile and int(os.environ.get("RANK", "0")) == 0:
            import cProfile

            cProfile.runctx("trainer.fit(module, loader)", globals(), locals(), args.profile)
        else:
            trainer.fit(module, loader)
    if trainer.is_global_zero:
        stamps.write()


def run_lightning(args: argparse.Namespace) -> None:
    from torch.utils.data import DataLoader

    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    torch.set_num_threads(1)
    stamps = Stamps(args.result)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = hf_llama()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return lm_loss(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Clock(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            stamps.stamp()

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy="ddp",
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    trainer.fit(Module(), DataLoader(samples(args.warmup + args.steps), batch_size=MICRO_BATCH))
    if trainer.is_global_zero:
        stamps.write()


RUNNERS = {"hand": run_hand, "ours": run_ours, "lightning": run_lightning}


# ---- the parent: rounds of the three arms, then the table -----------------------------------------------
def arm_speed(arm: str, args: argparse.Namespace) -> tuple[float, float]:
    """One 2-process job of `arm` in a fresh process: (global tokens/s at rank 0's median step time,
    rank 0's median CPU milliseconds per step)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "stamps.json"
        command = [sys.executable, __file__, "--arm", arm, "--result", str(result)]
        command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        command += ["--profile", args.profile] if args.profile and arm == "ours" else []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"arm {arm} exited {done.returncode}:\n{done.stderr[-3000:]}")
        times = json.loads(result.read_text())[args.warmup :]

    def median_step(i: int) -> float:
        return statistics.median(b[i] - a[i] for a, b in zip(times, times[1:], strict=False))

    return WORLD * MICRO_BATCH * SEQ_LEN / median_step(0), 1000 * median_step(1)


def peers(args: argparse.Namespace) -> None:
    measured: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]:  # rotated: no arm always runs first
            measured[arm].append(arm_speed(arm, args))
    tokens = {arm: statistics.median(t for t, _ in values) for arm, values in measured.items()}
    cpu = {arm: statistics.median(c for _, c in values) for arm, values in measured.items()}
    print(
        f"tiny HF Llama (4 layers, dim 128), seq {SEQ_LEN}, micro-batch {MICRO_BATCH} per process, AdamW, "
        f"{WORLD} gloo processes x 1 thread, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
        f"median of {args.rounds} interleaved rounds, {args.steps} timed steps after {args.warmup}"
    )
    for arm in ARMS:
        rounds = ", ".join(f"{t:.0f}" for t, _ in measured[arm])
        print(
            f"  {arm:<10} {tokens[arm]:8.0f} tokens/s (rounds: {rounds}); rank 0 CPU {cpu[arm]:6.1f} ms/step"
        )
    for peer, target in (("hand", 0.98), ("lightning", 1.0)):
        # the same ratio taken round by round: the host's speed drifts by ~10% over minutes, which moves
        # whole rounds; a ratio within a round cancels most of that
        paired = [o / q for (o, _), (q, _) in zip(measured["ours"], measured[peer], strict=True)]
        print(
            f"  ours / {peer:<9} tokens/s {tokens['ours'] / tokens[peer]:.3f}x (target >= {target}), "
            f"CPU per step {cpu['ours'] / cpu[peer]:.3f}x; round by round "
            f"{', '.join(f'{x:.3f}' for x in paired)} (median {statistics.median(paired):.3f}x)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["scaling", "peers"], default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile", default=None)  # a cProfile file of ours' rank 0
    p.add_argument("--arm", choices=ARMS, default=None)  # a child: one arm's job
    p.add_argument("--result", default=None)
    args = p.parse_args()
    if args.arm is not None:
        RUNNERS[args.arm](args)
        return
    if args.only in (None, "scaling"):
        scaling()
    if args.only in (None, "peers"):
        peers(args)


if __name__ == "__main__":
    main()
