"""Trains the tiny Llama under Parallel3DStrategy layouts, as a user's script run under torchrun would.

`--layouts` is a JSON list of {"tag": ..., **Parallel3DStrategy kwargs}; each is one `Trainer.fit` in
the same world. Rank 0 writes {tag: {"params": {name: values}}} to `--out`, the parameters gathered
whole from every shard and stage; the losses are in each run's metrics log under `--root`/tag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from helpers import token_loader  # noqa: E402

from strategies import Parallel3DStrategy  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.models.causal_lm import CausalLM  # noqa: E402
from trainer.models.llama import LlamaConfig  # noqa: E402

MODEL = LlamaConfig(
    vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=16, rope_theta=10000.0
)


def full_parameters(module: torch.nn.Module) -> dict[str, list]:
    """Every parameter whole, keyed by name, merged over the ranks (pipeline stages hold different ones)."""
    mine = {}
    for name, p in module.named_parameters():
        t = p.detach()
        mine[name.replace("._checkpoint_wrapped_module", "")] = (
            t.full_tensor() if hasattr(t, "full_tensor") else t
        ).tolist()
    merged: dict[str, list] = {}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    for part in parts:
        merged.update(part)
    return merged


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {}
    for layout in json.loads(args.layouts):
        tag = layout.pop("tag")
        strategy = Parallel3DStrategy(timeout_s=120, **layout)
        trainer = Trainer(
            strategy=strategy,
            devices="auto",
            max_steps=args.steps,
            seed=0,
            gradient_clip_val=1.0,
            default_root_dir=Path(args.root) / tag,
            enable_progress_bar=False,
            log_every_n_steps=1,
            callbacks=[__import__("gradcb").GradDump()] if __import__("os").environ.get("GRADDUMP") else [],
        )
        module = CausalLM(MODEL, lr=1e-3)
        # the loader's batch is per rank (as in Lightning): the global batch over the data-parallel ranks
        dp = int(os.environ["WORLD_SIZE"]) // (
            layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
        )
        trainer.fit(module, token_loader(args.global_batch // dp, MODEL.vocab_size))
        results[tag] = {"params": full_parameters(module)}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
