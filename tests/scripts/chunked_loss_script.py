"""A tied tiny Llama trained with CausalLM(loss_chunk_tokens=...) under FSDP and/or DDP, one after the other
in one self-spawned world of `--devices` processes: `python tests/scripts/chunked_loss_script.py --strategies
fsdp,ddp --root DIR`. Each strategy's step losses go to DIR/<strategy>'s metrics log; each rank writes
DIR/<strategy>/rank{r}.json with how many losses took the fused path."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import LLAMA, token_loader  # noqa: E402

from strategies import DDPStrategy, FSDPStrategy  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.models import causal_lm  # noqa: E402

TIED = dataclasses.replace(LLAMA, tie_embeddings=True)
GLOBAL_BATCH, CHUNK = 16, 24  # a rank's micro-batch of 8 x 16 tokens is 128: chunks of 24 leave 8 over


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategies", required=True)  # comma-separated: fsdp, ddp
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--root", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    fused = causal_lm.linear_cross_entropy
    for name in a.strategies.split(","):
        fused_calls = 0

        def counted(*args, **kwargs):
            nonlocal fused_calls
            fused_calls += 1
            return fused(*args, **kwargs)

        causal_lm.linear_cross_entropy = counted
        root = Path(a.root, name)
        trainer = Trainer(
            strategy=FSDPStrategy(zero_stage=3) if name == "fsdp" else DDPStrategy(),
            devices=a.devices,
            max_steps=a.steps,
            gradient_clip_val=0.5,
            seed=0,
            log_every_n_steps=1,
            val_check_interval=a.steps,
            limit_val_batches=2,
            enable_progress_bar=False,
            enable_checkpointing=False,
            default_root_dir=root,
        )
        micro = GLOBAL_BATCH // a.devices
        module = causal_lm.CausalLM(TIED, lr=1e-2, loss_chunk_tokens=CHUNK)
        trainer.fit(module, token_loader(micro), token_loader(micro, seed=2))
        (root / f"rank{trainer.strategy.global_rank}.json").write_text(
            json.dumps({"fused_calls": fused_calls})
        )


if __name__ == "__main__":
    main()
