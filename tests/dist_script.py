"""A training script the distributed tests run as a user would: `python tests/dist_script.py ...`
(self-spawning with --devices N) or under torchrun. Rank 0 writes the final parameters to --out."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import Regression, regression_loader  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from callbacks import Callback, ModelCheckpoint  # noqa: E402
from strategies import DDPStrategy, FSDPStrategy  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.data import PackedDataset, TokenLoader  # noqa: E402
from trainer.models.causal_lm import CausalLM  # noqa: E402
from trainer.models.llama import LlamaConfig  # noqa: E402

LLAMA = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, rope_theta=10000.0
)


def token_loader(batch_size: int) -> TokenLoader:
    tokens = torch.randint(0, 64, (4000,), generator=torch.Generator().manual_seed(0))
    return TokenLoader(PackedDataset(tokens, seq_len=16), batch_size=batch_size, shuffle=True, seed=1)


class MemoryProbe(Callback):
    """Records the strategy's per-rank memory report with gradients present and after the first step."""

    def __init__(self) -> None:
        self.grads = self.states = None

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if self.grads is None and hasattr(trainer.strategy, "memory_report"):
            self.grads = trainer.strategy.memory_report(module, optimizer).__dict__

    def on_train_batch_end(self, trainer, module, outputs):
        if self.states is None and hasattr(trainer.strategy, "memory_report"):
            self.states = trainer.strategy.memory_report(module, trainer.optimizer).__dict__


class Misbehave(Callback):
    """Raise, hang or die on one rank at one step, to test how the job ends."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_train_batch_end(self, trainer, module, outputs):
        a, rank, step = self.args, trainer.strategy.global_rank, trainer.global_step
        if rank != a.bad_rank or step != a.bad_step:
            return
        if a.raise_error:
            raise RuntimeError(f"deliberate failure on rank {rank} at step {step}")
        if a.hang:
            time.sleep(600)
        if a.sigkill and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", default="auto")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--compression", default=None)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--bad-rank", type=int, default=-1)
    p.add_argument("--bad-step", type=int, default=-1)
    p.add_argument("--raise-error", action="store_true")
    p.add_argument("--hang", action="store_true")
    p.add_argument("--sigkill", action="store_true")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--replicate", type=int, default=1)
    p.add_argument("--ac", default=None)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--precision", default="32")
    p.add_argument("--model", default="regression")
    p.add_argument("--validate", action="store_true")
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    devices = a.devices if a.devices == "auto" else int(a.devices)
    processes = (os.cpu_count() if devices == "auto" else devices) * a.num_nodes
    world = int(os.environ.get("WORLD_SIZE", processes if devices != "auto" else 1))
    micro = a.global_batch // (world * a.accumulate)
    if a.strategy == "fsdp":
        strategy = FSDPStrategy(
            zero_stage=a.stage,
            replicate=a.replicate,
            activation_checkpointing=a.ac,
            cpu_offload=a.offload,
            async_save=a.async_save,
            timeout_s=a.timeout,
        )
    else:
        strategy = DDPStrategy(gradient_compression=a.compression, powersgd_start_iter=2, timeout_s=a.timeout)
    probe = MemoryProbe()
    trainer = Trainer(
        strategy=strategy,
        devices=devices,
        num_nodes=a.num_nodes,
        max_steps=a.steps,
        precision=a.precision,
        accumulate_grad_batches=a.accumulate,
        gradient_clip_val=0.5,
        seed=0,
        log_every_n_steps=1,
        enable_progress_bar=False,
        default_root_dir=a.root,
        callbacks=[Misbehave(a), probe, ModelCheckpoint(every_n_steps=a.ckpt_every)],
    )
    if a.model == "llama":
        module, loader = CausalLM(LLAMA, lr=1e-2), token_loader(micro)
    else:
        module, loader = Regression(dropout=0.0), regression_loader(batch_size=micro, shuffle=a.shuffle)
    val_loader = None
    if a.validate:
        val_loader = token_loader(micro) if a.model == "llama" else regression_loader(batch_size=micro)
    trainer.fit(module, loader, val_loader, ckpt_path="last" if a.resume else None)
    params = [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().tolist()
        for p in module.parameters()
    ]
    rank = trainer.strategy.global_rank
    Path(a.root, f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid()}))
    if trainer.is_global_zero:
        Path(a.out).write_text(
            json.dumps(
                {
                    "world_size": trainer.strategy.world_size,
                    "params": params,
                    "memory": {"grads": probe.grads, "states": probe.states},
                }
            )
        )


if __name__ == "__main__":
    main()
