"""The architectures people fine-tune (tests/scripts/hf_families.py), each from a tiny random config, trained
by HFModule under DDP, FSDP ZeRO-3, tensor parallel (tp=2, transformers' own plan) and LoRA under DDP on two
processes, against one process on the same global batch: step losses, gradient norms, the exported weights
(`save_pretrained`, reloaded with the task's `AutoModelFor...`) and their logits. A cell a strategy cannot
train (tp for a family transformers gives no plan) is refused in one line. The whole matrix is one 2-process
launch (tests/scripts/hf_matrix_script.py); the one-process references run in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, read_metrics, run_ranks
from hf_families import CAUSAL, DECODERS, FAMILIES, GLOBAL_BATCH, STEPS, VARIANTS, loader, tiny_config
from hf_matrix_script import build, case_id
from hf_script import trainer_kwargs
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from trainer import Trainer

SCRIPT = SCRIPTS / "hf_matrix_script.py"
AUTO = {  # what a user reloads an export of each task with
    "causal-lm": AutoModelForCausalLM,
    "seq-classification": AutoModelForSequenceClassification,
    "token-classification": AutoModelForTokenClassification,
    "seq2seq": AutoModelForSeq2SeqLM,
}
PLANNED = [f for f in FAMILIES if tiny_config(f).base_model_tp_plan]  # the families transformers plans tp for


def cells() -> list[tuple[str, str, str]]:
    """(family, task, strategy) of every cell: DDP and FSDP for every task of every family, tp for each
    family's (refused where it has no plan), LoRA under DDP for the decoders, tp for the plan variants."""
    out = []
    for family, (_, _, tasks) in FAMILIES.items():
        for task in tasks:
            out += [(family, task, "ddp"), (family, task, "fsdp"), (family, task, "tp")]
            out += [(family, task, "lora")] if family in DECODERS else []
    return out + [(variant, CAUSAL, "tp") for variant in VARIANTS]


CELLS = cells()
TRAINED = [c for c in CELLS if c[2] != "tp" or c[0] in PLANNED or c[0] in VARIANTS]
REFUSED = [c for c in CELLS if c not in TRAINED]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> tuple[Path, dict]:
    """Every cell, one after another in one 2-process torchrun world; (runs' root, rank 0's results)."""
    tmp = tmp_path_factory.mktemp("hf-matrix")
    out = tmp / "results.json"
    run_ranks(
        2, SCRIPT, "--cases", json.dumps(CELLS), "--root", str(tmp), "--out", str(out),
        torchrun=True, timeout=280,
    )  # fmt: skip
    return tmp, json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """(family, task, lora) -> the one-process run of the same module on the same global batch: (its root,
    the trained module, the folder it exported to); each trained once."""
    tmp, done = tmp_path_factory.mktemp("hf-one"), {}

    def reference(family: str, task: str, lora: bool) -> tuple[Path, object, Path]:
        key = (family, task, lora)
        if key not in done:
            root = tmp / case_id(family, task, "lora" if lora else "one")
            module = build(family, task, lora)
            Trainer(enable_checkpointing=False, **trainer_kwargs(root, STEPS)).fit(
                module, loader(task, GLOBAL_BATCH)
            )
            done[key] = (root, module, module.save_pretrained(root / "export"))
        return done[key]

    return reference


def close(got: dict, expected: dict, what: str, rtol: float = 1e-5) -> None:
    """Per-step values equal within `rtol` of the one process's, at every step."""
    assert sorted(got, key=int) == [str(s) for s in range(1, STEPS + 1)], f"{what}: steps {sorted(got)}"
    for step, value in expected.items():
        assert abs(got[str(step)] - value) <= rtol * max(1.0, abs(value)), (
            f"{what} of step {step}: {got[str(step)]} against one process's {value}"
        )


def inputs(task: str) -> dict[str, torch.Tensor]:
    """The first global batch's model inputs (a seq2seq model's decoder fed its targets' ids)."""
    batch = next(iter(loader(task, GLOBAL_BATCH)))
    if task == "seq2seq":
        return {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    return {"input_ids": batch["input_ids"]}


@pytest.mark.slow
@pytest.mark.parametrize("family,task,strategy", TRAINED, ids=[case_id(*c) for c in TRAINED])
def test_two_processes_train_and_export_like_one(matrix, one_process, family, task, strategy):
    tmp, results = matrix
    got = results[case_id(family, task, strategy)]
    assert "refused" not in got, got.get("refused")
    root, module, export = one_process(family, task, strategy == "lora")
    close(got["losses"], read_metrics(root), "loss")
    close(got["grad_norms"], read_metrics(root, "train/grad_norm"), "gradient norm", rtol=1e-4)

    # the exported weights are the one process's, and reload with transformers to its logits
    auto = AUTO[task]
    exported = auto.from_pretrained(tmp / case_id(family, task, strategy) / "export")
    reference = auto.from_pretrained(export).state_dict()
    for name, tensor in exported.state_dict().items():
        assert (tensor - reference[name]).abs().max().item() <= 1e-5, f"exported {name}"
    module.eval()
    with torch.no_grad():
        live = module.model(**inputs(task)).logits
        assert (exported(**inputs(task)).logits - live).abs().max().item() <= 1e-4

    if strategy == "tp":  # every module of the plan was split (or, a per-head norm, replicated) over tp
        for pattern in tiny_config(family).base_model_tp_plan:
            tail = pattern.replace("*.", "")
            assert any(f".{tail}." in f".{name}" for name in got["tp_layout"]), (pattern, got["tp_layout"])


@pytest.mark.slow
@pytest.mark.parametrize("family,task,strategy", REFUSED, ids=[case_id(*c) for c in REFUSED])
def test_cells_without_a_plan_are_refused_in_one_line(matrix, family, task, strategy):
    refusal = matrix[1][case_id(family, task, strategy)].get("refused")
    assert refusal is not None and "\n" not in refusal
    if family == "Falcon":  # multi-query: its one key-value head cannot split, which is checked first
        assert refusal.startswith("tp=2 does not divide the model's 1 kv-heads"), refusal
        return
    model_type = FAMILIES[family][0]
    assert f"({model_type!r})" in refusal and "no tensor-parallel plan" in refusal and "tp=1" in refusal
