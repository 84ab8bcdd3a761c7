"""Pad token and labels: a Llama tokenizer without a pad token fine-tunes for classification at batch 8 (the
model is told the EOS id the loaders pad with); string or ClassLabel labels become class ids without a
manual class_encode_column, and their names reach the exported config."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from hf_script import trainer_kwargs
from test_hf_module import TINY_BERT, TINY_LLAMA, tiny_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoConfig,
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from callbacks import ModelCheckpoint
from trainer import Trainer
from trainer.checkpoint import find_last
from trainer.checkpoint.export import export_checkpoint
from trainer.config import build_run, load_recipe
from trainer.data.hf_data import class_names, hf_dataloaders
from trainer.models.hf import HFModule

WORDS = [f"w{i}" for i in range(40)]
REPO = Path(__file__).parents[2]


def texts(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [
        " ".join(WORDS[int(i)] for i in torch.randint(0, 40, (int(k),), generator=g))
        for k in torch.randint(2, 9, (n,), generator=g)
    ]


@pytest.fixture(scope="module")
def llama_no_pad(tmp_path_factory) -> Path:
    """A tiny Llama without pad_token_id and a word-level tokenizer with EOS but no pad token."""
    folder = tmp_path_factory.mktemp("llama-no-pad")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, pad_token_id=None, eos_token_id=1)).save_pretrained(folder)
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(folder)
    return folder


def test_a_llama_tokenizer_without_pad_fine_tunes_for_classification_at_batch_8(llama_no_pad, tmp_path):
    module = HFModule(llama_no_pad, task="seq-classification", num_labels=2, lr=1e-2)
    assert module.tokenizer.pad_token_id is None and module.hf_model().config.pad_token_id == 1  # EOS
    data = datasets.Dataset.from_dict({"text": texts(64, 0), "label": [i % 2 for i in range(64)]})
    train, _ = hf_dataloaders(data, module.tokenizer, "seq-classification", batch_size=8, val_fraction=0)
    batch = next(iter(train))
    assert batch["input_ids"].shape[0] == 8 and (batch["attention_mask"] == 0).any()  # padded with EOS
    Trainer(**trainer_kwargs(tmp_path, 3)).fit(module, train)

    # each padded row is classified as it would be alone: the model pools the last token before the padding
    module.eval()
    with torch.no_grad():
        padded = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        for row, (ids, mask) in enumerate(zip(batch["input_ids"], batch["attention_mask"], strict=True)):
            alone = module(input_ids=ids[mask.bool()][None]).logits[0]
            assert (padded[row] - alone).abs().max() <= 1e-5, row


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    BertModel(BertConfig(**TINY_BERT)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_string_labels_become_class_ids_and_the_exported_config_names_them(bert_dir, tmp_path):
    words = ["neutral", "positive", "negative"]
    rows = [words[i % 3] for i in range(48)]
    data = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": texts(48, 1), "label": rows}),
        validation=datasets.Dataset.from_dict({"text": texts(6, 2), "label": ["positive", "negative"] * 3}),
    )
    names = class_names(data)
    assert names == ["negative", "neutral", "positive"]  # sorted, as class_encode_column numbers them
    module = HFModule(bert_dir, task="seq-classification", labels=names, lr=1e-2)
    assert module.hf_model().config.num_labels == 3
    train, val = hf_dataloaders(data, module.tokenizer, "seq-classification", batch_size=8, labels=names)
    expected = torch.tensor([names.index(w) for w in rows])
    assert torch.equal(torch.cat([b["labels"] for b in in_order(train)]), expected)
    assert [int(x) for b in val for x in b["labels"]] == [2, 0] * 3
    trainer = Trainer(**trainer_kwargs(tmp_path / "run", 2), callbacks=[ModelCheckpoint(every_n_steps=2)])
    trainer.fit(module, train, val)
    id2label = {0: "negative", 1: "neutral", 2: "positive"}
    assert AutoConfig.from_pretrained(module.save_pretrained(tmp_path / "live")).id2label == id2label
    exported = export_checkpoint(find_last(trainer.checkpoint_dir), tmp_path / "exported")
    config = AutoConfig.from_pretrained(exported.parent)
    assert config.id2label == id2label and config.label2id == {v: k for k, v in id2label.items()}

    # a ClassLabel's ints are its names' ids, renumbered when other labels are asked for
    coded = data["train"].cast_column("label", datasets.ClassLabel(names=["positive", "neutral", "negative"]))
    assert class_names(coded) == ["positive", "neutral", "negative"]
    plain, _ = hf_dataloaders(coded, module.tokenizer, "seq-classification", batch_size=8, val_fraction=0)
    renamed, _ = hf_dataloaders(
        coded, module.tokenizer, "seq-classification", batch_size=8, val_fraction=0, labels=names
    )
    assert torch.equal(torch.cat([b["labels"] for b in in_order(renamed)]), expected)
    assert torch.equal(
        torch.cat([b["labels"] for b in in_order(plain)]),
        torch.tensor([["positive", "neutral", "negative"].index(w) for w in rows]),
    )
    with pytest.raises(ValueError) as err:
        hf_dataloaders(
            data, module.tokenizer, "seq-classification", batch_size=8, labels=["negative", "positive"]
        )
    assert (
        str(err.value)
        == "label 'neutral' is not one of the classes ['negative', 'positive']; allowed: one of those"
    )
    with pytest.raises(
        ValueError, match=r"labels=\['a', 'b'\] with num_labels=3; allowed: distinct class names"
    ):
        HFModule(bert_dir, task="seq-classification", labels=["a", "b"], num_labels=3)


def in_order(loader):
    """The loader's examples in dataset order (the train loader shuffles)."""
    return torch.utils.data.DataLoader(loader.dataset, batch_size=8, collate_fn=loader.collate_fn)


def test_a_recipe_with_string_labels_names_its_classes(bert_dir, tmp_path):
    rows = [{"text": t, "label": ["tech", "sport"][i % 2]} for i, t in enumerate(texts(16, 3))]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_recipe(
        REPO / "recipes" / "hf_classify_minilm.yaml",
        [f"model.hf={bert_dir}", "model.num_labels=2", f"data.path={tmp_path / 'train.jsonl'}", "data.val_path=null",
         "data.batch_size=4", f"trainer.default_root_dir={tmp_path / 'run'}"],
    )  # fmt: skip
    _, module, train, _ = build_run(config)
    assert module.hf_model().config.id2label == {0: "sport", 1: "tech"}
    assert sorted({int(x) for b in in_order(train) for x in b["labels"]}) == [0, 1]
