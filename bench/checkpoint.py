"""What checkpoint validation costs: a validated save vs a plain save of the tiny recipe's Llama, same process.

A plain save writes the files and their SHA-256 manifest. A validated save adds: the live loss on the
held-out batch, re-hashing every file, loading the checkpoint into the module (after stashing it) and a
second forward. Both are timed alternately, best of ROUNDS; the ratio is validated / plain.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from callbacks import Callback, ModelCheckpoint
from trainer import Trainer
from trainer.checkpoint import file_sha256
from trainer.config import build_llama_config, load_recipe
from trainer.data import lm_dataloaders
from trainer.models.causal_lm import CausalLM

RECIPE = load_recipe(Path(__file__).parents[1] / "recipes" / "llama_tiny.yaml")
ROUNDS = 7


class TimeSaves(Callback):
    """At the end of fit: time plain and validated saves of the same state, alternately."""

    def __init__(self, root: Path) -> None:
        self.root, self.plain, self.validated = root, [], []

    def on_fit_end(self, trainer, module) -> None:
        for i in range(ROUNDS):
            start = time.perf_counter()
            trainer.save_checkpoint(self.root / f"plain-{i}")
            self.plain.append(time.perf_counter() - start)
            saver = ModelCheckpoint(dirpath=self.root / f"validated-{i}")
            start = time.perf_counter()
            saver.save(trainer)
            self.validated.append(time.perf_counter() - start)
            assert saver.saved[-1]["good"], "the validated save must pass"


def main() -> None:
    torch.set_num_threads(2)
    data = RECIPE["data"]
    loader = lm_dataloaders(None, seq_len=data["seq_len"], batch_size=data["batch_size"])[0]
    with tempfile.TemporaryDirectory() as tmp:
        timer = TimeSaves(Path(tmp))
        Trainer(
            max_steps=2,
            enable_progress_bar=False,
            enable_checkpointing=False,
            callbacks=[timer],
            default_root_dir=tmp,
        ).fit(CausalLM(build_llama_config(RECIPE["model"])), loader)
        files = list((Path(tmp) / "plain-0").iterdir())
        size = sum(f.stat().st_size for f in files)
        start = time.perf_counter()
        for f in files:
            file_sha256(f)
        hash_s = time.perf_counter() - start
    plain, validated = min(timer.plain), min(timer.validated)
    print(f"checkpoint of {size / 1e6:.1f} MB (tiny Llama: model, AdamW state, loop state)")
    print(f"plain save (files + SHA-256 manifest): {plain * 1e3:.1f} ms")
    print(f"validated save (+ re-hash, reload, two forwards): {validated * 1e3:.1f} ms")
    print(f"validated / plain: {validated / plain:.2f}")
    print(f"SHA-256 of the files: {size / hash_s / 1e9:.2f} GB/s on one core")


if __name__ == "__main__":
    main()
