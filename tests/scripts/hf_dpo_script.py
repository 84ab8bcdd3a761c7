"""DPO of a tiny Hugging Face Llama as a user's script under torchrun would run it (`helpers.launch_layouts`):
`--layouts '[{"tag": "ddp"}, {"tag": "fsdp"}]'`, each tag one `Trainer.fit` of `--steps` steps in the same
world, logging under `--root`/tag. test_hf_dpo.py imports the model, data and settings from here, so its
one-process reference trains on exactly the same pairs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from hf_script import trainer_kwargs  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from strategies import DDPStrategy, FSDPStrategy  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.data.hf_preference import preference_dataloaders  # noqa: E402
from trainer.models.hf import HFModule  # noqa: E402

GLOBAL_BATCH, LR, BETA, SEQ_LEN = 8, 3e-3, 0.5, 32


def preference_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Pairs whose chosen answer counts up from the prompt's digit and whose rejected one counts down."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for start in torch.randint(0, 10, (n,), generator=g).tolist():
        up = " ".join(str((start + k) % 10) for k in range(4))
        down = " ".join(str((start - k) % 10) for k in range(4))
        records.append({"prompt": f"from {start}:", "chosen": up, "rejected": down})
    return records


def tokenizer():
    """The byte tokenizer without its chat template: prompt bytes, response bytes, EOS."""
    from trainer.models.hf_create import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = None
    return tok


def tiny_llama(seed: int = 0):
    """A 2-layer LlamaForCausalLM over the byte vocabulary, the same on every rank (seeded here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def pair_loader(batch_size: int, n: int = 64) -> DataLoader:
    """The pairs in order (not shuffled): one process's batch k holds what the ranks' k-th batches hold."""
    import datasets

    train, _ = preference_dataloaders(
        datasets.Dataset.from_list(preference_records(n)), tokenizer(), seq_len=SEQ_LEN, batch_size=batch_size,
        val_fraction=0,
    )  # fmt: skip
    return DataLoader(train.dataset, batch_size=batch_size, collate_fn=train.collate_fn, drop_last=True)


def dpo_module() -> HFModule:
    """The policy and its frozen reference (a copy of its initial weights)."""
    return HFModule(tiny_llama(), task="dpo", beta=BETA, lr=LR)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    done = []
    for layout in json.loads(a.layouts):
        tag = layout["tag"]
        strategy = FSDPStrategy(zero_stage=3, timeout_s=120) if tag == "fsdp" else DDPStrategy(timeout_s=120)
        trainer = Trainer(strategy=strategy, devices="auto", **trainer_kwargs(Path(a.root) / tag, a.steps))
        trainer.fit(dpo_module(), pair_loader(GLOBAL_BATCH // int(os.environ["WORLD_SIZE"])))
        done.append({"tag": tag, "world_size": trainer.strategy.world_size})
    if os.environ.get("RANK", "0") == "0":
        Path(a.out).write_text(json.dumps(done))


if __name__ == "__main__":
    main()
