"""A profiled training run the profiler tests start as a user would: `python tests/profile_script.py
--devices 2 --root DIR` self-spawns DDP ranks (gloo on the CPU) that train a tiny Llama under the Profiler
and the ThroughputMonitor."""

from __future__ import annotations

import argparse

import torch

from callbacks.profiler import Profiler
from callbacks.throughput import ThroughputMonitor
from trainer import Trainer
from trainer.data import PackedDataset, TokenLoader
from trainer.models.causal_lm import CausalLM
from trainer.models.llama import LlamaConfig

LLAMA = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, rope_theta=10000.0
)
SEQ_LEN = 16


def token_loader(micro_batch: int) -> TokenLoader:
    """Random tokens in SEQ_LEN blocks: batches {"input_ids", "labels"} of shape [micro_batch, SEQ_LEN]."""
    tokens = torch.randint(0, LLAMA.vocab_size, (4000,), generator=torch.Generator().manual_seed(0))
    return TokenLoader(PackedDataset(tokens, seq_len=SEQ_LEN), batch_size=micro_batch, shuffle=True, seed=1)


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
