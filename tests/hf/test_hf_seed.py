"""`Trainer(seed=...)` decides an HFModule's randomly initialised weights (a model built from a config, a
new head, LoRA's A matrices), whatever torch's RNG held when the module was built; weights changed after
building are kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_script import trainer_kwargs
from test_hf_module import TINY_BERT, class_data
from torch.utils.data import DataLoader
from transformers import BertConfig, BertModel

from trainer import Trainer
from trainer.models.hf import HFModule

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["query", "value"]}
pytestmark = pytest.mark.filterwarnings(
    "error:.*is_gradient_checkpointing.*:FutureWarning"
)  # peft reads it: kept out of sight


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    BertModel(BertConfig(**TINY_BERT)).save_pretrained(folder)
    return folder


def build(source: str, folder: Path, rng_seed: int) -> HFModule:
    torch.manual_seed(rng_seed)  # what the process's RNG happens to hold when the module is built
    if source == "config":
        return HFModule(BertConfig(**TINY_BERT), task="seq-classification", num_labels=3, lr=3e-3)
    return HFModule(folder, task="seq-classification", num_labels=3, lr=3e-3, lora=LORA)


def trained(module: HFModule, root: Path, seed: int) -> dict[str, torch.Tensor]:
    train = DataLoader(class_data(64, 0), batch_size=16)
    Trainer(**{**trainer_kwargs(root, 2), "seed": seed}).fit(module, train)
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("source", ["config", "folder+lora"])
def test_the_trainer_seed_decides_the_new_weights_whatever_the_rng_held_before(source, bert_dir, tmp_path):
    a, b = build(source, bert_dir, 1), build(source, bert_dir, 2)
    new = [n for n, p in a.named_parameters() if p.requires_grad]
    assert any(not torch.equal(a.state_dict()[n], b.state_dict()[n]) for n in new)  # as built: different
    first, second = trained(a, tmp_path / "a", seed=0), trained(b, tmp_path / "b", seed=0)
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
    other = trained(build(source, bert_dir, 1), tmp_path / "c", seed=5)
    assert any(not torch.equal(first[n], other[n]) for n in new)


def test_weights_set_after_building_are_not_drawn_again(bert_dir, tmp_path):
    module = build("folder+lora", bert_dir, 1)
    head = next(p for n, p in module.named_parameters() if n.endswith("modules_to_save.default.weight"))
    with torch.no_grad():
        head.fill_(0.125)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module._trainer = Trainer(**trainer_kwargs(tmp_path, 1))
    module.configure_model()
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
