"""A LoRA checkpoint knows its base model by the bytes of its weights, not by its folder: a byte-identical
copy of the base in another folder resumes exactly, and weights rewritten in place (same folder, same
config) are refused in one line. Tiny BERT classifiers, one process."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_hf_adapters import lora_fit
from test_hf_module import TINY_BERT, tiny_tokenizer
from transformers import BertConfig, BertModel

from trainer.checkpoint import find_last
from trainer.checkpoint.export import export_checkpoint
from trainer.models.hf_adapters import BaseModelMismatch

pytestmark = pytest.mark.filterwarnings(
    "error:.*is_gradient_checkpointing.*:FutureWarning"
)  # peft reads it: kept out of sight


def save_base(folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    BertModel(BertConfig(**TINY_BERT)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def trained(tmp_path) -> tuple[Path, Path]:
    """A base model's folder and the checkpoint of 4 LoRA steps over it."""
    base = save_base(tmp_path / "base", seed=0)
    _, trainer = lora_fit(base, tmp_path / "first", 4)
    return base, find_last(trainer.checkpoint_dir)


def test_a_byte_identical_copy_of_the_base_in_another_folder_resumes_exactly(trained, tmp_path):
    base, ckpt = trained
    copy = shutil.copytree(base, tmp_path / "elsewhere" / "base-copy")
    resumed, _ = lora_fit(copy, tmp_path / "resumed", 8, ckpt_path=ckpt)
    straight, _ = lora_fit(base, tmp_path / "straight", 8)
    for (name, got), want in zip(resumed.state_dict().items(), straight.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_base_weights_changed_in_place_are_refused_in_one_line(trained, tmp_path):
    base, ckpt = trained
    save_base(tmp_path / "other", seed=1)  # same config, other weights, written over the base's own file
    shutil.copyfile(tmp_path / "other" / "model.safetensors", base / "model.safetensors")
    with pytest.raises(BaseModelMismatch) as err:  # the class the CLI prints in one line
        lora_fit(base, tmp_path / "changed", 8, ckpt_path=ckpt)
    line = str(err.value)
    assert "\n" not in line and f"{base.resolve()}" in line and "(its weights changed since)" in line, line
    with pytest.raises(ValueError, match="its weights changed since"):  # nor exported onto them
        export_checkpoint(ckpt, tmp_path / "export")
