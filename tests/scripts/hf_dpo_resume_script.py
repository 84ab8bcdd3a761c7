"""DPO of the tiny Hugging Face Llama (hf_dpo_script's) saved and resumed under DDP and FSDP as a user's
script under torchrun would: per tag, 4 steps with a checkpoint every 2, then the same run resumed from step
2 in a new folder. Rank 0 writes to --out the model keys of each tag's sharded checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from hf_dpo_script import GLOBAL_BATCH, dpo_module, pair_loader  # noqa: E402
from hf_script import trainer_kwargs  # noqa: E402

from callbacks import ModelCheckpoint  # noqa: E402
from strategies import DDPStrategy, FSDPStrategy  # noqa: E402
from strategies.checkpoint_io.dcp_files import saved_entries  # noqa: E402
from trainer import Trainer  # noqa: E402

STEPS, SAVED = 4, "step-00000002"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    keys = {}
    for tag in ("ddp", "fsdp"):
        for run in ("straight", "resumed"):
            strategy = (
                FSDPStrategy(zero_stage=3, timeout_s=120) if tag == "fsdp" else DDPStrategy(timeout_s=120)
            )
            root = Path(a.root) / tag / run
            trainer = Trainer(
                strategy=strategy, devices="auto", callbacks=[ModelCheckpoint(every_n_steps=2)],
                **trainer_kwargs(root, STEPS),
            )  # fmt: skip
            ckpt = Path(a.root) / tag / "straight" / "checkpoints" / SAVED if run == "resumed" else None
            trainer.fit(
                dpo_module(), pair_loader(GLOBAL_BATCH // int(os.environ["WORLD_SIZE"])), ckpt_path=ckpt
            )
        keys[tag] = sorted(
            {
                k.split(".", 1)[1]
                for k in saved_entries(Path(a.root) / tag / "straight" / "checkpoints" / SAVED)
                if k.startswith("model.")
            }
        )
    if os.environ.get("RANK", "0") == "0":
        Path(a.out).write_text(json.dumps(keys))


if __name__ == "__main__":
    main()
