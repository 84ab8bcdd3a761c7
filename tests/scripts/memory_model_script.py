"""Trains the Llama of the memory-model tests under several layouts, one after another in one world, and
measures each rank's peak of tracked CPU allocations over the whole fit (model built, sharded, two
optimizer steps): what strategies/plan/memory.py predicts.

`--layouts` is a JSON list of {"tag", "strategy" (a registry name), "kwargs" (the strategy's), "model"
(a key of MODELS), "precision", "activation_checkpointing", "loss_chunk_tokens"}. Rank 0 writes
{tag: [peak bytes of rank 0, rank 1, ...]} to `--out`.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist

from callbacks import Callback
from strategies.registry import build_strategy
from trainer import Trainer
from trainer.core.memory_peak import PeakBytes
from trainer.models.causal_lm import CausalLM
from trainer.models.llama import LlamaConfig

# big enough that weights, optimizer state, activations and logits each show in the peak, small enough
# for a few fits on a loaded CPU
MODELS = {
    "dense": LlamaConfig(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=128,
                         rope_theta=10000.0),
    "moe": LlamaConfig.preset("moe-tiny", max_seq_len=128, vocab_size=2048, dim=128),
}  # fmt: skip
STEPS = 2


class SettleBeforeStep(Callback):
    """Before each step: frees reference cycles (the garbage collector would free an earlier step's at a
    different moment on each rank and run), and passes a barrier, so gloo lets go of the buffers of the
    last collective it ran (it keeps them until its next one: DDP's broadcast of the weights, ZeRO-1's
    last gather). What a step then holds is the step's own tensors, which is what the model predicts."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        gc.collect()
        if dist.is_initialized():
            dist.barrier()


class Tokens(torch.utils.data.Dataset):
    """Random token blocks {"input_ids", "labels"} of `seq_len` (the loss is what is measured, not learned)."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def measure(layout: dict, root: Path, micro_batch: int, seq_len: int, processes: int) -> int:
    """This rank's peak bytes over one fit of `layout`."""
    config = MODELS[layout.get("model", "dense")]
    strategy = build_strategy(layout["strategy"], processes=processes, **layout.get("kwargs", {}))
    trainer = Trainer(
        strategy=strategy,
        devices="auto",
        max_steps=STEPS,
        seed=0,
        precision=layout.get("precision", "32"),
        activation_checkpointing=layout.get("activation_checkpointing"),
        default_root_dir=root,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=[SettleBeforeStep()],
    )
    # every rank reads `micro_batch` sequences a step, whatever the strategy shards the dataset over
    data = Tokens(micro_batch * STEPS * processes, seq_len, config.vocab_size)
    loader = torch.utils.data.DataLoader(data, micro_batch)
    module = CausalLM(config, loss_chunk_tokens=layout.get("loss_chunk_tokens"))
    tracker = PeakBytes()
    with tracker.track():
        trainer.fit(module, loader)
    return tracker.peak


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", required=True)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--devices", default=None)  # one process: no launcher
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    results = {}
    for layout in json.loads(args.layouts):
        peak = measure(layout, Path(args.root) / layout["tag"], args.micro_batch, args.seq_len, world)
        peaks = [peak]
        if dist.is_initialized():
            peaks = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, peak)
        results[layout["tag"]] = peaks
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
