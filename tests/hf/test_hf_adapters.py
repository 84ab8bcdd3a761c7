"""LoRA adapters kept as adapters: checkpoints of a LoRA HFModule over a base read from its folder hold the
trainable weights and the base's identity only, resume exactly onto that base and are refused onto another;
`save_pretrained(merged=False)` and `trainer export --adapter` write PEFT's layout, which
`peft.PeftModel.from_pretrained` loads to the trained logits. Tiny BERT classifiers, one process; the
MiniLM under DDP(2) is in test_hf_minilm_lora.py."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
from hf_script import trainer_kwargs
from safetensors import safe_open
from test_hf_module import TINY_BERT, class_data, tiny_tokenizer
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, BertConfig, BertModel

from callbacks import ModelCheckpoint
from trainer import Trainer
from trainer.checkpoint import MODEL_FILE, find_last
from trainer.checkpoint.export import export_checkpoint
from trainer.models.hf import HFModule

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["query", "value"]}
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*is_gradient_checkpointing.*:FutureWarning"
)  # the tests call peft themselves


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> tuple[Path, Path]:
    """Two base encoders of the same config with different weights, each with its tokenizer."""
    folders = []
    for seed in (0, 1):
        folder = tmp_path_factory.mktemp(f"bert-{seed}")
        torch.manual_seed(seed)
        BertModel(BertConfig(**TINY_BERT)).save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
        folders.append(folder)
    return folders[0], folders[1]


def lora_fit(base: Path, root: Path, steps: int, ckpt_path=None) -> tuple[HFModule, Trainer]:
    module = HFModule(base, task="seq-classification", num_labels=3, lr=3e-3, lora=LORA)
    trainer = Trainer(**trainer_kwargs(root, steps), callbacks=[ModelCheckpoint(every_n_steps=4)])
    train = DataLoader(
        class_data(256, 0), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    trainer.fit(module, train, ckpt_path=ckpt_path)
    return module, trainer


def val_batch() -> dict[str, torch.Tensor]:
    return next(iter(DataLoader(class_data(16, 1), batch_size=16)))


def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def trained(bases, tmp_path_factory) -> tuple[HFModule, Path]:
    """A LoRA run of 4 steps and its checkpoint."""
    module, trainer = lora_fit(bases[0], tmp_path_factory.mktemp("lora"), 4)
    return module, find_last(trainer.checkpoint_dir)


def test_checkpoints_hold_the_trainable_weights_and_resume_exactly_onto_their_base_only(
    bases, trained, tmp_path
):
    module, ckpt = trained
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    with safe_open(ckpt / MODEL_FILE, "pt") as f:
        assert set(f.keys()) == trainable  # the LoRA matrices and the new head's trained copy
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)
    full = sum(p.numel() * p.element_size() for p in module.state_dict().values())
    saved = (ckpt / MODEL_FILE).stat().st_size
    print(f"model file: {saved} bytes with adapters only, {full} bytes of the full state dict")
    assert saved < 0.2 * full

    # 4 steps, then 4 more resumed from the adapters-only checkpoint == 8 steps in one go
    resumed, _ = lora_fit(bases[0], tmp_path / "resumed", 8, ckpt_path=ckpt)
    straight, _ = lora_fit(bases[0], tmp_path / "straight", 8)
    for (name, got), want in zip(resumed.state_dict().items(), straight.state_dict().values(), strict=True):
        assert torch.equal(got, want), name

    with pytest.raises(ValueError) as err:  # same shapes, another base: the identity tells them apart
        lora_fit(bases[1], tmp_path / "other", 8, ckpt_path=ckpt)
    line = str(err.value)
    assert "\n" not in line and str(bases[0].resolve()) in line and str(bases[1].resolve()) in line, line


def test_adapters_in_peft_layout_load_with_peft_to_the_trained_logits(bases, trained, tmp_path):
    module, ckpt = trained
    batch = val_batch()
    want = logits(module, batch)

    def peft_logits(folder: Path) -> torch.Tensor:
        base = AutoModelForSequenceClassification.from_pretrained(bases[0], num_labels=3)
        return logits(peft.PeftModel.from_pretrained(base, folder), batch)

    out = module.save_pretrained(tmp_path / "adapter", merged=False)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in out.iterdir()}
    assert not (out / "model.safetensors").exists()
    live = (peft_logits(out) - want).abs().max().item()
    exported = export_checkpoint(ckpt, tmp_path / "exported", merged=False)
    from_ckpt = (peft_logits(exported.parent) - want).abs().max().item()
    merged = export_checkpoint(ckpt, tmp_path / "merged")
    as_merged = (
        (logits(AutoModelForSequenceClassification.from_pretrained(merged.parent), batch) - want).abs().max()
    )
    print(
        f"PEFT reload vs trained logits: {live:.2e} (live), {from_ckpt:.2e} (checkpoint), merged {as_merged:.2e}"
    )
    assert live <= 1e-5 and from_ckpt <= 1e-5 and as_merged <= 1e-5
    assert (
        want - logits(AutoModelForSequenceClassification.from_pretrained(bases[0], num_labels=3), batch)
    ).abs().max() > 1e-3

    with pytest.raises(
        ValueError, match=r"save_pretrained\(merged=False\) writes LoRA adapters.*allowed: merged=True"
    ):
        HFModule(bases[0], task="seq-classification", num_labels=3).save_pretrained(
            tmp_path / "x", merged=False
        )


def test_the_start_line_counts_trainable_parameters_as_peft_does(bases, tmp_path, caplog):
    lora = HFModule(bases[0], task="seq-classification", num_labels=3, lora=LORA)
    frozen = HFModule(bases[0], task="seq-classification", num_labels=3, freeze=["bert.embeddings.*"])
    train = DataLoader(class_data(16, 0), batch_size=16)
    caplog.set_level("INFO", logger="trainer")
    for name, module in (("lora", lora), ("frozen", frozen)):
        caplog.clear()
        Trainer(**trainer_kwargs(tmp_path / name, 1)).fit(module, train)
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        total = sum(p.numel() for p in module.parameters())
        assert trainable < total
        if module is lora:
            assert (trainable, total) == lora.model.get_nb_trainable_parameters()  # PEFT's own count
        line = f"HFModule: trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f} |"
        assert line in caplog.text, name
