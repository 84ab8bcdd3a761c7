"""Hugging Face datasets -> DataLoaders (trainer.data.hf_data), from a user's side: a tiny local tokenizer
with a chat template, data as jsonl files and save_to_disk folders, exact labels on hand-built examples."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from strategies.privacy.poisson_data import poisson_loader
from trainer import Trainer, TrainModule
from trainer.data.distributed import shard_loader
from trainer.data.hf_data import hf_dataloaders, load_hf_dataset

SPECIALS = ["<pad>", "<unk>", "<eos>", "<bos>", "<|user|>", "<|assistant|>"]
WORDS = "hello world how are you fine thanks the cat sat on mat good bad play ##ing ##s".split()
VOCAB = {token: i for i, token in enumerate(SPECIALS + WORDS)}
PAD, EOS, BOS = VOCAB["<pad>"], VOCAB["<eos>"], VOCAB["<bos>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
X = -100  # an ignored label


def ids(tokens: str) -> list[int]:
    """The ids of space-separated vocabulary entries: the expected values, independent of the tokenizer."""
    return [VOCAB[token] for token in tokens.split()]


def make_tokenizer(directory: Path, pad: bool = True, eos: bool = True, template: bool = True) -> Path:
    """A WordPiece tokenizer over VOCAB ("playing" -> play ##ing) that puts <bos> first when asked for
    special tokens, saved with save_pretrained; whole words map to single ids."""
    backend = Tokenizer(models.WordPiece(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>" if eos else None,
        pad_token="<pad>" if pad else None,
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    if template:
        tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """datasets' own cache (load_dataset of data files) inside the test's temp dir."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


DOCS = ["hello world", "the cat sat on the mat", "good", "how are you", "fine thanks"]


def test_packing_gives_windows_of_the_eos_separated_stream_with_labels_shifted(tmp_path, tok_dir):
    data = write_jsonl(tmp_path / "docs.jsonl", [{"text": doc} for doc in DOCS])
    train, val = hf_dataloaders(data, tok_dir, seq_len=4, batch_size=2, val_fraction=0)
    stream = [t for doc in DOCS for t in [*ids(doc), EOS]]  # 18 tokens: (18 - 1) // 4 = 4 blocks
    assert val is None and len(train.dataset) == 4 and len(train) == 2
    windows = {tuple(stream[i * 4 : i * 4 + 5]) for i in range(4)}
    seen = set()
    for batch in train:
        assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].dtype == torch.long
        assert batch["input_ids"].shape == batch["labels"].shape == (2, 4)
        assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
        seen |= {tuple(row) for row in torch.cat([batch["input_ids"], batch["labels"][:, -1:]], 1).tolist()}
    assert seen == windows


def test_load_hf_dataset_reads_files_folders_and_save_to_disk(tmp_path):
    rows = [{"text": doc} for doc in DOCS]
    single = load_hf_dataset(write_jsonl(tmp_path / "one.jsonl", rows))
    assert isinstance(single, datasets.Dataset) and single["text"] == DOCS
    write_jsonl(tmp_path / "files" / "train.jsonl", rows[:3])
    write_jsonl(tmp_path / "files" / "validation.jsonl", rows[3:])
    folder = load_hf_dataset(tmp_path / "files")
    assert {name: len(split) for name, split in folder.items()} == {"train": 3, "validation": 2}
    datasets.DatasetDict(train=single, test=single.select([0])).save_to_disk(tmp_path / "saved")
    assert set(load_hf_dataset(tmp_path / "saved")) == {"train", "test"}
    assert load_hf_dataset(tmp_path / "saved", split="test")["text"] == ["hello world"]
    with pytest.raises(ValueError) as error:
        load_hf_dataset(tmp_path / "saved", split="dev")
    assert "has no split 'dev'; allowed: one of ['train', 'test']" in one_line(error)


def test_sft_prompt_and_response_without_template_train_on_the_response_and_eos_only(tmp_path, caplog):
    plain = make_tokenizer(tmp_path / "plain", template=False)
    data = datasets.Dataset.from_dict(
        {
            "prompt": ["hello how are you", "the cat sat on the mat good"],
            "response": ["fine thanks", "bad"],
        }
    )
    with caplog.at_level(logging.WARNING, logger="trainer"):
        train, _ = hf_dataloaders(
            data,
            plain,
            seq_len=6,
            batch_size=1,
            val_fraction=0,
            prompt_field="prompt",
            response_field="response",
        )
    # tokens: hello how are you | fine thanks <eos>: 7 = seq_len + 1; the second's prompt fills all 7
    assert len(train.dataset) == 1
    assert "train: dropped 1 of 2 examples with no target token within seq_len" in caplog.text
    batch = next(iter(train))
    assert batch["input_ids"].tolist() == [ids("hello how are you fine thanks")]
    assert batch["labels"].tolist() == [[X, X, X, *ids("fine thanks <eos>")]]
    assert batch["attention_mask"].tolist() == [[1] * 6]


def test_sft_messages_through_the_chat_template_count_only_assistant_turns(tmp_path, tok_dir):
    conversation = [
        {"role": "user", "content": "hello how are you"},
        {"role": "assistant", "content": "fine thanks"},
        {"role": "user", "content": "good"},
        {"role": "assistant", "content": "bad"},
    ]
    data = datasets.Dataset.from_dict({"messages": [conversation]})
    train, _ = hf_dataloaders(
        data, tok_dir, seq_len=64, batch_size=1, val_fraction=0, messages_field="messages"
    )
    tokens = ids(
        "<|user|> hello how are you <eos> <|assistant|> fine thanks <eos> <|user|> good <eos> <|assistant|> bad <eos>"
    )
    batch = next(iter(train))
    assert batch["input_ids"].tolist() == [tokens[:-1]]
    labels = batch["labels"][0].tolist()
    targets = {t: label for t, label in enumerate(labels) if label != X}
    # position t predicts token t + 1: fine(7) thanks(8) <eos>(9), bad(14) <eos>(15)
    assert targets == dict(zip([6, 7, 8, 13, 14], ids("fine thanks <eos> bad <eos>"), strict=True))

    # with a template, a prompt/response pair is one user/assistant exchange
    pairs = datasets.Dataset.from_dict({"q": ["hello"], "a": ["fine"]})
    train, _ = hf_dataloaders(
        pairs, tok_dir, seq_len=64, batch_size=1, val_fraction=0, prompt_field="q", response_field="a"
    )
    batch = next(iter(train))
    assert batch["input_ids"].tolist() == [ids("<|user|> hello <eos> <|assistant|> fine")]
    assert batch["labels"].tolist() == [[X, X, X, *ids("fine <eos>")]]


def test_dynamic_padding_pads_ids_with_pad_labels_with_ignore_and_masks_attention(tmp_path, tok_dir):
    data = datasets.Dataset.from_dict({"text": ["hello world", "the cat sat on the mat"]})
    train, _ = hf_dataloaders(data, tok_dir, seq_len=16, batch_size=2, val_fraction=0, packing=False)
    batch = next(iter(train))
    order = batch["attention_mask"].sum(1).argsort().tolist()  # short row first
    assert batch["input_ids"][order].tolist() == [
        [*ids("hello world"), PAD, PAD, PAD, PAD],
        ids("the cat sat on the mat"),
    ]
    assert batch["labels"][order].tolist() == [
        [*ids("world <eos>"), X, X, X, X],
        ids("cat sat on the mat <eos>"),
    ]
    assert batch["attention_mask"][order].tolist() == [[1, 1, 0, 0, 0, 0], [1] * 6]


def test_a_tokenizer_without_pad_pads_with_eos_and_warns_once(tmp_path, caplog):
    no_pad = make_tokenizer(tmp_path / "no-pad", pad=False)
    data = datasets.Dataset.from_dict({"text": ["good", "hello world"], "label": [1, 0]})
    splits = datasets.DatasetDict(train=data, validation=data)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        for _ in range(2):
            _, val = hf_dataloaders(splits, no_pad, "seq-classification", batch_size=2)
    warnings = [r.getMessage() for r in caplog.records if "no pad token" in r.getMessage()]
    assert warnings == [
        f"tokenizer {no_pad} has no pad token: padding with its EOS id {EOS} (attention_mask 0, label -100 there)"
    ]
    batch = next(iter(val))
    assert batch["input_ids"].tolist() == [[BOS, *ids("good"), EOS], [BOS, *ids("hello world")]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert AutoTokenizer.from_pretrained(no_pad).pad_token is None  # the tokenizer is not changed


def test_classification_batches(tmp_path, tok_dir):
    text = datasets.Dataset.from_dict({"text": ["good", "the cat sat", "bad play"], "label": [1, 0, 2]})
    _, val = hf_dataloaders(
        datasets.DatasetDict(train=text, validation=text), tok_dir, "seq-classification", batch_size=3
    )
    batch = next(iter(val))
    assert batch["input_ids"].tolist() == [
        [BOS, *ids("good"), PAD, PAD],
        [BOS, *ids("the cat sat")],
        [BOS, *ids("bad play"), PAD],
    ]
    assert batch["labels"].tolist() == [1, 0, 2] and batch["labels"].dtype == torch.long
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]

    words = datasets.Dataset.from_dict(
        {"tokens": [["playing", "cat"], ["the", "cats", "sat"]], "tags": [[1, 2], [0, 2, 1]]}
    )
    _, val = hf_dataloaders(
        datasets.DatasetDict(train=words, test=words),
        tok_dir,
        "token-classification",
        batch_size=2,
        text_field="tokens",
        label_field="tags",
    )
    batch = next(iter(val))
    assert batch["input_ids"].tolist() == [[BOS, *ids("play ##ing cat"), PAD], [BOS, *ids("the cat ##s sat")]]
    # a word's label on its first token; <bos>, continuations and padding ignored
    assert batch["labels"].tolist() == [[X, 1, X, 2, X], [X, 0, 2, X, 1]]


def test_validation_comes_from_val_path_or_the_eval_split_asked_for(tmp_path, tok_dir):
    train = datasets.Dataset.from_dict({"text": ["good", "bad play", "the cat"], "label": [1, 0, 2]})
    held_out = datasets.Dataset.from_dict({"text": ["the cat sat"], "label": [2]})
    dev = datasets.Dataset.from_dict({"text": ["good play"], "label": [1]})
    write_jsonl(tmp_path / "val.jsonl", [{"text": "hello world", "label": 0}])

    def val_texts(**options) -> list[list[int]]:
        _, val = hf_dataloaders(
            options.pop("data", train), tok_dir, "seq-classification", batch_size=1, **options
        )
        return [row for batch in val for row in batch["input_ids"].tolist()]

    assert val_texts(val_path=tmp_path / "val.jsonl") == [[BOS, *ids("hello world")]]
    assert val_texts(val_path=held_out) == [[BOS, *ids("the cat sat")]]
    splits = datasets.DatasetDict(train=train, validation=held_out, dev=dev)
    assert val_texts(data=splits) == [[BOS, *ids("the cat sat")]]
    assert val_texts(data=splits, eval_split="dev") == [[BOS, *ids("good play")]]
    with pytest.raises(ValueError) as error:
        val_texts(data=splits, eval_split="tests")
    assert (
        one_line(error)
        == "eval_split='tests' is not a split of the data; allowed: one of ['train', 'validation', 'dev']"
    )
    with pytest.raises(ValueError) as error:
        val_texts(eval_split="dev")
    assert "allowed: val_path or val_fraction" in one_line(error)
    with pytest.raises(ValueError) as error:
        val_texts(val_path=held_out, eval_split="dev")
    assert one_line(error) == "val_path and eval_split are both set; allowed: one of them"


def test_bad_inputs_are_refused_in_one_line(tmp_path, tok_dir):
    data = datasets.Dataset.from_dict({"text": DOCS, "label": ["a", "b", "a", "b", "a"]})
    with pytest.raises(FileNotFoundError) as error:
        hf_dataloaders(tmp_path / "missing.jsonl", tok_dir)
    assert "missing.jsonl' does not exist" in one_line(error)
    with pytest.raises(FileNotFoundError) as error:
        hf_dataloaders(data, tmp_path / "no-tokenizer")
    assert "tokenizer path" in one_line(error)
    with pytest.raises(ValueError) as error:
        hf_dataloaders(data, tok_dir, text_field="body")
    assert one_line(error) == "field 'body' is not in the dataset; available columns: ['text', 'label']"
    with pytest.raises(ValueError) as error:  # string labels are encoded (test_hf_labels.py); floats are not
        hf_dataloaders(
            data.remove_columns("label").add_column("label", [0.5] * 5), tok_dir, "seq-classification"
        )
    assert "allowed: ints, strings or a ClassLabel" in one_line(error)
    bare = make_tokenizer(tmp_path / "bare", pad=False, eos=False)
    with pytest.raises(ValueError) as error:
        hf_dataloaders(data, bare, packing=False)
    assert "the tokenizer has no EOS token" in one_line(error)
    with pytest.raises(ValueError) as error:
        hf_dataloaders(data.remove_columns("label").add_column("label", [0] * 5), bare, "seq-classification")
    assert "the tokenizer has neither a pad nor an EOS token" in one_line(error)
    with pytest.raises(ValueError) as error:
        hf_dataloaders(data, tok_dir, "summarise")
    assert "allowed: causal-lm, seq-classification, token-classification" in one_line(error)
    with pytest.raises(ValueError) as error:
        hf_dataloaders(data, tok_dir, seq_len=512, batch_size=2)  # 5 short texts: one block of 512 at most
    assert "train split too small" in one_line(error)


class TinyLM(TrainModule):
    """Next-token cross-entropy on already-shifted labels (-100 ignored), as the batch convention says."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(len(VOCAB), 8)
        self.head = torch.nn.Linear(8, len(VOCAB))

    def training_step(self, batch, batch_idx):
        logits = self.head(self.emb(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fit_refuses_a_raw_dataset_in_one_line_and_trains_on_its_loaders(tmp_path, tok_dir):
    data = datasets.Dataset.from_dict({"text": DOCS * 4})
    trainer = Trainer(max_steps=2, default_root_dir=tmp_path / "run", enable_progress_bar=False)
    with pytest.raises(TypeError) as error:
        trainer.fit(TinyLM(), data)
    assert "got a datasets.Dataset, which yields single rows, not batches" in one_line(error)
    assert "hf_dataloaders" in str(error.value)

    train, val = hf_dataloaders(data, tok_dir, seq_len=4, batch_size=2, val_fraction=0.2, packing=False)
    trainer = Trainer(max_steps=2, default_root_dir=tmp_path / "run2", enable_progress_bar=False)
    trainer.fit(TinyLM(), train, val)
    assert trainer.global_step == 2


def test_loaders_shard_over_ranks_and_poisson_sample(tok_dir):
    data = datasets.Dataset.from_dict({"text": [f"{w} {w}" for w in WORDS[:12]]})
    train, _ = hf_dataloaders(data, tok_dir, batch_size=2, val_fraction=0, packing=False)
    shards = [
        [tuple(row) for b in shard_loader(train, r, 2, seed=0) for row in b["input_ids"].tolist()]
        for r in range(2)
    ]
    assert len(shards[0]) == len(shards[1]) == 6 and set(shards[0]).isdisjoint(shards[1])
    sampled, rate, expected = poisson_loader(train, world=1, rank=0, seed=0)
    assert (rate, expected) == (2 / 12, 2) and all(b["input_ids"].dim() == 2 for b in sampled)


def test_a_second_call_reads_the_tokenised_cache(tmp_path, tok_dir, monkeypatch):
    def run(data, **kwargs):
        train, _ = hf_dataloaders(data, tok_dir, seq_len=4, batch_size=2, val_fraction=0, **kwargs)
        return sorted(tuple(row) for batch in train for row in batch["input_ids"].tolist())

    in_memory = datasets.Dataset.from_dict({"text": DOCS})
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": doc} for doc in DOCS])
    first = run(in_memory, cache_dir=tmp_path / "cache"), run(path)
    assert len(list((tmp_path / "cache").glob("hf-*.arrow"))) == 1

    def no_tokenising(*args, **kwargs):
        raise AssertionError("tokenised again")

    tokenizer_class = type(AutoTokenizer.from_pretrained(tok_dir))
    with monkeypatch.context() as patch:
        patch.setattr(tokenizer_class, "__call__", no_tokenising)
        assert (run(in_memory, cache_dir=tmp_path / "cache"), run(path)) == first
        with pytest.raises(AssertionError, match="tokenised again"):  # other settings: another cache entry
            run(in_memory, cache_dir=tmp_path / "cache", packing=False)
