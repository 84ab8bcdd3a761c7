"""Hugging Face datasets -> (train, validation) torch DataLoaders for causal LM (plain text or SFT) and
classification, in the batch convention of `trainer.data`.

Loaders are plain DataLoaders over map-style datasets, so the framework's data-parallel sharding and
DP-SGD's Poisson sampling apply to them as to any user loader. Tokenisation runs once through
`Dataset.map` and is cached (see `hf_dataloaders`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from trainer.data.packing import PackedDataset
from trainer.data.rows import MESSAGES, TEXT, check_rows, remember_origin
from trainer.data.sft_packing import PackedExamples
from trainer.data.unreadable import read_data

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

TASKS = ("causal-lm", "seq-classification", "token-classification")
IGNORE_INDEX = -100  # a label no loss counts (cross_entropy's default ignore_index)
# data-file suffix -> the datasets builder that reads it
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
VALIDATION_SPLITS = ("validation", "test")  # a DatasetDict's split used for validation, first found
_CACHE_VERSION = 1  # bump when the tokenised columns change, so old cache files are not reused
_WARNED_PAD: set[str] = set()  # tokenizers already warned about padding with EOS


def load_hf_dataset(path: str | os.PathLike[str], split: str | None = None) -> Dataset | DatasetDict:
    """A dataset from a local `path`: a `save_to_disk` folder (as saved), a data file (one Dataset, its
    "train" split unless `split`), or a folder of data files (splits named by the files, as datasets infers)."""
    import datasets

    location = Path(path)
    if not location.exists():
        raise FileNotFoundError(
            f"dataset path {str(location)!r} does not exist; allowed: a folder saved with save_to_disk, or a "
            f"{'/'.join(DATA_FILE_BUILDERS)} file or a folder of them"
        )
    if location.is_file():
        builder = DATA_FILE_BUILDERS.get(location.suffix.lower())
        if builder is None:
            raise ValueError(
                f"{str(location)!r} is not a known data file; allowed: a file ending in {', '.join(DATA_FILE_BUILDERS)}"
            )
        loaded = read_data(location, [location], builder, data_files=str(location), split=split or "train")
        return remember_origin(loaded, location)
    if (location / "dataset_dict.json").is_file() or (location / "state.json").is_file():
        return _select_split(datasets.load_from_disk(str(location)), split, location)
    files = sorted(file for file in location.rglob("*") if file.suffix.lower() in DATA_FILE_BUILDERS)
    if not files:
        raise ValueError(
            f"{str(location)!r} holds neither a save_to_disk dataset nor data files; allowed: a folder saved "
            f"with save_to_disk, or one with {'/'.join(DATA_FILE_BUILDERS)} files"
        )
    return read_data(location, files, None, split=split)


def _select_split(loaded: Dataset | DatasetDict, split: str | None, location: Path) -> Dataset | DatasetDict:
    """`split` of a dataset read with load_from_disk (all of it when None)."""
    from datasets import DatasetDict

    if split is None:
        return loaded
    if not isinstance(loaded, DatasetDict):
        raise ValueError(f"{str(location)!r} holds one Dataset without splits; allowed: split=None")
    if split not in loaded:
        raise ValueError(f"{str(location)!r} has no split {split!r}; allowed: one of {list(loaded)}")
    return loaded[split]


def hf_dataloaders(
    data: str | os.PathLike[str] | Dataset | DatasetDict,
    tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase,
    task: str = "causal-lm",
    *,
    seq_len: int = 512,
    batch_size: int = 8,
    val_fraction: float = 0.05,
    seed: int = 0,
    text_field: str = "text",
    prompt_field: str | None = None,
    response_field: str | None = None,
    messages_field: str | None = None,
    label_field: str = "label",
    packing: bool = True,
    sft_packing: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    labels: Sequence[str] | None = None,
    val_path: str | os.PathLike[str] | Dataset | None = None,
    eval_split: str | None = None,
    skip_bad_rows: bool = False,
) -> tuple[DataLoader, DataLoader | None]:
    """(train, validation or None) DataLoaders of `data` (a path for `load_hf_dataset`, a Dataset or a
    DatasetDict) tokenised by `tokenizer` (an object, or a local save_pretrained folder).

    task="causal-lm" yields {"input_ids", "labels"[, "attention_mask"]} LongTensor[B, T], labels already
    shifted (labels[b, t] is the target of position t, -100 ignored):
    - plain text (`text_field`): each text's tokens then EOS (no BOS); packing=True cuts the stream of all
      texts into windows of seq_len + 1 tokens (no padding), packing=False truncates each text to
      seq_len + 1 tokens and pads per batch;
    - SFT (`prompt_field` + `response_field`, or `messages_field` holding [{"role", "content"}] lists):
      only response tokens are targets, all others -100. Messages need the tokenizer's chat template;
      a prompt/response pair goes through it as one user/assistant exchange when the tokenizer has one,
      else as prompt tokens, response tokens, EOS. Examples are truncated to seq_len + 1 tokens and
      dropped when no response token is left. sft_packing=True packs whole examples into rows of seq_len
      tokens with "position_ids" restarting at each example and no attention_mask (PackedExamples; HFModule
      keeps attention inside each example); sft_packing=False (the default) pads each batch.
    task="seq-classification": `text_field` with labels `label_field`, labels LongTensor[B];
    task="token-classification": `text_field` holds word lists and `label_field` one label per word, the
    label on each word's first token, -100 on special and continuation tokens (needs a fast tokenizer).
    Labels are ints (kept), strings or a ClassLabel's: those become the index of their name in `labels`
    (the class names in id order; default `class_names(data)`: a ClassLabel's names, else the sorted
    distinct strings of the train split), so give the model the same `HFModule(labels=...)`.

    Padding is to the longest example of the batch: pad id, label -100, attention_mask 0. A tokenizer
    without a pad token pads with its EOS id (warned once; the tokenizer is not changed).
    Splits: `val_path` (a data file, a save_to_disk Dataset or a Dataset) is the validation data when
    given; else a DatasetDict's "train" and its `eval_split` (default: "validation", else "test"); otherwise
    `val_fraction` of the examples, chosen with `seed`, is validation (0: no validation loader). The train loader
    shuffles with a generator seeded by `seed` and drops its last incomplete batch.
    Tokenised data is cached by the source's fingerprint, the tokenizer and these settings: under
    `cache_dir` when given, else beside a file-backed dataset's own cache (in-memory data: not cached).
    Rows whose text, prompt, response or messages are missing or not strings fail in one line naming the row
    (FILE:LINE of a JSON-lines file) and field (trainer.data.rows), or with `skip_bad_rows` are left out
    and counted.
    """
    _check_settings(task, seq_len, batch_size, val_fraction, prompt_field, response_field, messages_field)
    tok = _load_tokenizer(tokenizer)
    source = load_hf_dataset(data) if isinstance(data, (str, os.PathLike)) else data
    if val_path is not None:
        if eval_split is not None:
            raise ValueError("val_path and eval_split are both set; allowed: one of them")
        source, eval_split = _with_validation(source, val_path), "validation"
    mode = _mode(task, prompt_field, response_field, messages_field)
    fields = {
        "text": [text_field],
        "sft": [messages_field] if messages_field is not None else [prompt_field, response_field],
        "seq-classification": [text_field, label_field],
        "token-classification": [text_field, label_field],
    }[mode]
    kind = MESSAGES if messages_field is not None else TEXT
    checked = fields if mode in ("text", "sft") else fields[:1] if mode == "seq-classification" else []
    source = check_rows(source, dict.fromkeys(checked, kind), skip_bad_rows)
    train_raw, val_raw = _splits(source, val_fraction, seed, eval_split)
    for raw in (train_raw, val_raw):
        if raw is not None:
            _check_columns(raw, fields, mode, label_field)
    has_template = getattr(tok, "chat_template", None) is not None
    if messages_field is not None and not has_template:
        raise ValueError(
            f"messages_field={messages_field!r} needs the tokenizer's chat template, and it has none; allowed: "
            "a tokenizer with chat_template set, or prompt_field/response_field"
        )
    chat = mode == "sft" and has_template
    if mode in ("text", "sft") and not chat and tok.eos_token_id is None:
        raise ValueError(
            "the tokenizer has no EOS token, which ends every causal-LM text; allowed: a tokenizer with eos_token set"
        )
    if (chat or mode == "token-classification") and not getattr(tok, "is_fast", False):
        raise ValueError(
            f"{mode} with this data needs token offsets, which only fast tokenizers give; allowed: a fast "
            "tokenizer (one with a tokenizer.json)"
        )
    pack = (mode == "text" and packing) or (mode == "sft" and sft_packing)
    encoder = _Encoder(
        tok, mode, fields, seq_len, pack, chat, _label_ids(train_raw, label_field, mode, labels)
    )
    collate = None if pack else PadCollator(_pad_id(tok))
    train = _loader("train", train_raw, encoder, cache_dir, batch_size, collate, seed)
    val = (
        None
        if val_raw is None
        else _loader("validation", val_raw, encoder, cache_dir, batch_size, collate, seed)
    )
    return train, val


def _loader(
    split: str,
    raw: Dataset,
    encoder: _Encoder,
    cache_dir: str | os.PathLike[str] | None,
    batch_size: int,
    collate: PadCollator | None,
    seed: int,
) -> DataLoader:
    """`raw` tokenised (and packed) in a DataLoader: training shuffles (seeded) and drops a short last batch."""
    tokenised = _tokenise(raw, encoder, split, cache_dir)
    dataset: Dataset | PackedDataset | PackedExamples = tokenised
    if encoder.pack and encoder.mode == "text":
        dataset = _pack(tokenised, encoder.seq_len)
    elif encoder.pack:  # whole SFT examples, several to a row
        rows = tokenised.with_format(None)
        dataset = PackedExamples(
            list(rows["input_ids"]), list(rows["labels"]), encoder.seq_len, _pad_id(encoder.tokenizer)
        )
    _check_size(split, dataset, len(raw), batch_size, encoder.pack)
    if len(tokenised) < len(raw):
        logger.warning(
            "%s: dropped %d of %d examples with no target token within seq_len",
            split,
            len(raw) - len(tokenised),
            len(raw),
        )
    logger.info(
        "%s: %d %s from %d examples (%s)",
        split,
        len(dataset),
        ("blocks" if encoder.mode == "text" else "packed rows") if encoder.pack else "examples",
        len(raw),
        encoder.mode,
    )
    train = split == "train"
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train,
        generator=torch.Generator().manual_seed(seed) if train else None,
        drop_last=train,
        collate_fn=collate,
    )


class PadCollator:
    """Examples {"input_ids": list, "labels": list | int} -> one batch padded to its longest example
    (pad id, label -100, attention_mask 0), all LongTensor; a class so DataLoader workers can pickle it."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(example["input_ids"]) for example in examples)
        ids = torch.full((len(examples), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        per_token = not isinstance(examples[0]["labels"], int)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long) if per_token else None
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            ids[row, :n] = torch.tensor(example["input_ids"], dtype=torch.long)
            mask[row, :n] = 1
            if labels is not None:
                labels[row, :n] = torch.tensor(example["labels"], dtype=torch.long)
        if labels is None:
            labels = torch.tensor([example["labels"] for example in examples], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class _Encoder:
    """The batched `Dataset.map` function: raw columns -> "input_ids" (and "labels" unless packing)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        mode: str,
        fields: list[str],
        seq_len: int,
        pack: bool,
        chat: bool,
        label_ids: tuple[dict[str, int], list[str] | None] | None = None,
    ) -> None:
        self.tokenizer, self.mode, self.fields = tokenizer, mode, fields
        self.seq_len, self.pack, self.chat = seq_len, pack, chat
        self.label_ids = label_ids  # (name -> id, a ClassLabel's names of its ints or None); None: ints kept

    def settings(self) -> list[Any]:
        """What the tokenised columns depend on besides the source data and the tokenizer (the cache key)."""
        return [_CACHE_VERSION, self.mode, self.fields, self.seq_len, self.pack, self.chat, self.label_ids]

    def _label(self, value: Any) -> int:
        """A label's class id: an int as it is, else the index of its name (a string, a ClassLabel's int)."""
        if self.label_ids is None:
            return int(value)
        label2id, source_names = self.label_ids
        name = source_names[value] if source_names is not None else value
        if name not in label2id:
            raise ValueError(
                f"label {name!r} is not one of the classes {list(label2id)}; allowed: one of those"
            )
        return label2id[name]

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if self.mode == "seq-classification":
            encoded = self.tokenizer(batch[self.fields[0]], truncation=True, max_length=self.seq_len)
            return {
                "input_ids": encoded["input_ids"],
                "labels": [self._label(label) for label in batch[self.fields[1]]],
            }
        if self.mode == "token-classification":
            return self._word_labels(batch[self.fields[0]], batch[self.fields[1]])
        if self.mode == "text":
            eos = [self.tokenizer.eos_token_id]
            ids = self.tokenizer(batch[self.fields[0]], add_special_tokens=False)["input_ids"]
            examples = [(doc + eos, [True] * (len(doc) + 1)) for doc in ids]
            if self.pack:
                return {"input_ids": [doc for doc, _ in examples]}
        elif self.chat:
            examples = [self._chat(conversation) for conversation in self._conversations(batch)]
        else:
            examples = [
                self._prompt_response(p, r)
                for p, r in zip(batch[self.fields[0]], batch[self.fields[1]], strict=True)
            ]
        out: dict[str, list[Any]] = {"input_ids": [], "labels": []}
        for ids, is_target in examples:
            shifted = self._shift(ids, is_target)
            if shifted is not None:
                out["input_ids"].append(shifted[0])
                out["labels"].append(shifted[1])
        return out

    def example(self, prompt: str, response: str) -> tuple[list[int], list[int]] | None:
        """One prompt/response pair as (input_ids, shifted labels), as SFT encodes it (through the chat
        template when there is one); None when truncation leaves no response token."""
        if self.chat:
            encoded = self._chat(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            )
        else:
            encoded = self._prompt_response(prompt, response)
        return self._shift(*encoded)

    def _shift(self, ids: list[int], is_target: list[bool]) -> tuple[list[int], list[int]] | None:
        """(input_ids, labels) of the first seq_len + 1 tokens, labels shifted and -100 where not a target;
        None when no target is left."""
        ids, is_target = ids[: self.seq_len + 1], is_target[: self.seq_len + 1]
        labels = [t if target else IGNORE_INDEX for t, target in zip(ids[1:], is_target[1:], strict=True)]
        if all(label == IGNORE_INDEX for label in labels):
            return None
        return ids[:-1], labels

    def _conversations(self, batch: dict[str, list[Any]]) -> list[list[dict[str, str]]]:
        if len(self.fields) == 1:
            return batch[self.fields[0]]
        return [
            [{"role": "user", "content": p}, {"role": "assistant", "content": r}]
            for p, r in zip(batch[self.fields[0]], batch[self.fields[1]], strict=True)
        ]

    def _prompt_response(self, prompt: str, response: str) -> tuple[list[int], list[bool]]:
        """Prompt tokens, response tokens, EOS; the response and EOS are targets."""
        tok = self.tokenizer
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return p + r, [False] * len(p) + [True] * len(r)

    def _chat(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        """The conversation through the chat template; targets: the tokens starting inside an assistant
        turn's text, i.e. after the template's generation prompt up to the end of that turn."""
        tok = self.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            through = tok.apply_chat_template(messages[: i + 1], tokenize=False)
            if not (text.startswith(before) and text.startswith(through)):
                raise ValueError(
                    "the chat template does not render a conversation's first turns as a prefix of the whole, "
                    "so its response tokens cannot be found; allowed: a prefix-stable template, or "
                    "prompt_field/response_field with a tokenizer without one"
                )
            spans.append((len(before), len(through)))
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        is_target = [any(a <= start < b for a, b in spans) for start, _ in encoded["offset_mapping"]]
        return encoded["input_ids"], is_target

    def _word_labels(self, words: list[list[str]], word_labels: list[list[int]]) -> dict[str, list[Any]]:
        """Tokens of each word list, each word's label on its first token, -100 on the others."""
        encoded = self.tokenizer(words, is_split_into_words=True, truncation=True, max_length=self.seq_len)
        labels = []
        for row, tags in enumerate(word_labels):
            previous, aligned = None, []
            for word in encoded.word_ids(row):
                aligned.append(IGNORE_INDEX if word is None or word == previous else self._label(tags[word]))
                previous = word
            labels.append(aligned)
        return {"input_ids": encoded["input_ids"], "labels": labels}


def _check_settings(
    task: str,
    seq_len: int,
    batch_size: int,
    val_fraction: float,
    prompt_field: str | None,
    response_field: str | None,
    messages_field: str | None,
) -> None:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; allowed: {', '.join(TASKS)}")
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid; allowed: an int >= 1")
    if isinstance(val_fraction, bool) or not (
        isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1
    ):
        raise ValueError(
            f"val_fraction={val_fraction!r} is invalid; allowed: a number with 0 <= val_fraction < 1"
        )
    if (prompt_field is None) != (response_field is None):
        raise ValueError(
            f"prompt_field={prompt_field!r} and response_field={response_field!r}; allowed: both set or neither"
        )
    if messages_field is not None and prompt_field is not None:
        raise ValueError("messages_field and prompt_field/response_field are both set; allowed: one of them")
    if task != "causal-lm" and (messages_field is not None or prompt_field is not None):
        raise ValueError(
            f"prompt/response/messages fields are for SFT; allowed: them with task='causal-lm', not {task!r}"
        )


def _mode(task: str, prompt_field: str | None, response_field: str | None, messages_field: str | None) -> str:
    """ "text", "sft", or the classification task."""
    if task != "causal-lm":
        return task
    return "sft" if messages_field is not None or prompt_field is not None else "text"


def _load_tokenizer(tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """A tokenizer object as given, or read from a local folder (no download)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(
            f"tokenizer is a {type(tokenizer).__name__}; allowed: a transformers tokenizer or a local folder path"
        )
    if not Path(tokenizer).exists():
        raise FileNotFoundError(
            f"tokenizer path {str(tokenizer)!r} does not exist; allowed: a folder saved with save_pretrained"
        )
    return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)


def _with_validation(source: Any, val_path: Any) -> DatasetDict:
    """`source`'s train split with `val_path`'s examples as its "validation" split."""
    from datasets import Dataset, DatasetDict

    val = load_hf_dataset(val_path) if isinstance(val_path, (str, os.PathLike)) else val_path
    if not isinstance(val, Dataset):
        raise ValueError(
            f"val_path holds a {type(val).__name__}; allowed: one split (a data file, a save_to_disk Dataset or "
            "a datasets.Dataset), or eval_split to pick one of a DatasetDict"
        )
    train = source["train"] if isinstance(source, DatasetDict) and "train" in source else source
    return DatasetDict(train=train, validation=val)


def _splits(
    data: Any, val_fraction: float, seed: int, eval_split: str | None = None
) -> tuple[Dataset, Dataset | None]:
    """(train, validation or None): a DatasetDict's own splits, else `val_fraction` split off with `seed`."""
    from datasets import Dataset, DatasetDict

    if isinstance(data, DatasetDict):
        if "train" not in data:
            raise ValueError(f"the DatasetDict has splits {list(data)}; allowed: one with a 'train' split")
        if eval_split is not None and eval_split not in data:
            raise ValueError(
                f"eval_split={eval_split!r} is not a split of the data; allowed: one of {list(data)}"
            )
        names = (eval_split,) if eval_split is not None else VALIDATION_SPLITS
        val_name = next((name for name in names if name in data), None)
        if val_name is not None:
            return data["train"], data[val_name]
        data = data["train"]
    elif eval_split is not None:
        raise ValueError(
            f"eval_split={eval_split!r} picks a split of a DatasetDict, and the data is one Dataset; allowed: "
            "val_path or val_fraction"
        )
    if not isinstance(data, Dataset):
        raise TypeError(
            f"data is a {type(data).__name__}; allowed: a path, a datasets.Dataset or a DatasetDict (map-style)"
        )
    if val_fraction == 0:
        return data, None
    if len(data) - math.ceil(len(data) * val_fraction) < 1:
        raise ValueError(
            f"{len(data)} examples leave none for training after val_fraction={val_fraction}; allowed: more "
            "examples, val_fraction=0, or a DatasetDict with a 'validation' split"
        )
    parts = data.train_test_split(test_size=val_fraction, seed=seed)
    return parts["train"], parts["test"]


def _check_columns(data: Dataset, fields: list[str], mode: str, label_field: str) -> None:
    """Every field named is a column; classification labels are ints (one per word for token labels)."""
    from datasets import ClassLabel, Value

    for field in fields:
        if field not in data.column_names:
            raise ValueError(f"field {field!r} is not in the dataset; available columns: {data.column_names}")
    if mode not in ("seq-classification", "token-classification"):
        return
    feature = _label_feature(data, label_field, mode)
    if not (
        isinstance(feature, ClassLabel)
        or (
            isinstance(feature, Value)
            and ("int" in feature.dtype or feature.dtype in ("string", "large_string"))
        )
    ):
        raise ValueError(
            f"labels {label_field!r} are {data.features[label_field]}; allowed: ints, strings or a ClassLabel"
            f"{' (one list per example)' if mode == 'token-classification' else ''}"
        )


def _label_feature(data: Dataset, label_field: str, mode: str) -> Any:
    """The feature of one label (of one word's, for token classification)."""
    feature = data.features[label_field]
    return getattr(feature, "feature", None) if mode == "token-classification" else feature


def class_names(
    data: str | os.PathLike[str] | Dataset | DatasetDict,
    label_field: str = "label",
    task: str = "seq-classification",
) -> list[str] | None:
    """The class names of classification data, in id order: a ClassLabel's names, else the sorted distinct
    strings of its train split (what `class_encode_column` would make); None for int labels."""
    source = load_hf_dataset(data) if isinstance(data, (str, os.PathLike)) else data
    train, _ = _splits(source, 0, 0)
    _check_columns(train, [label_field], task, label_field)
    return _names(train, label_field, task)


def _names(train: Dataset, label_field: str, mode: str) -> list[str] | None:
    from datasets import ClassLabel

    feature = _label_feature(train, label_field, mode)
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    if "int" in feature.dtype:
        return None
    column = train[label_field]
    values = {v for row in column for v in row} if mode == "token-classification" else set(column)
    return sorted(values)


def _label_ids(
    train: Dataset, label_field: str, mode: str, labels: Sequence[str] | None
) -> tuple[dict[str, int], list[str] | None] | None:
    """How the encoder turns labels into class ids: (name -> id, a ClassLabel's names or None), or None
    when the labels are ids already (ints, or a ClassLabel's own order with no other `labels` asked)."""
    from datasets import ClassLabel

    if mode not in ("seq-classification", "token-classification"):
        return None
    if labels is not None and (isinstance(labels, str) or len(set(labels)) != len(labels) or not labels):
        raise ValueError(f"labels={labels!r} is invalid; allowed: a list of distinct class names")
    feature = _label_feature(train, label_field, mode)
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
        return (
            None if labels is None or list(labels) == names else ({n: i for i, n in enumerate(labels)}, names)
        )
    names = _names(train, label_field, mode)
    if names is None:
        return None
    return {n: i for i, n in enumerate(labels if labels is not None else names)}, None


def padding_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The id the loaders pad batches with: the tokenizer's pad token, else its EOS (None: neither)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """`padding_id`, warned about once when it is EOS (its value is masked out either way)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "the tokenizer has neither a pad nor an EOS token, so batches cannot be padded; allowed: a tokenizer "
            "with pad_token (or eos_token) set"
        )
    name = tokenizer.name_or_path or type(tokenizer).__name__
    if name not in _WARNED_PAD:
        _WARNED_PAD.add(name)
        logger.warning(
            "tokenizer %s has no pad token: padding with its EOS id %d (attention_mask 0, label -100 there)",
            name,
            tokenizer.eos_token_id,
        )
    return tokenizer.eos_token_id


def _tokenise(
    raw: Dataset, encoder: _Encoder, split: str, cache_dir: str | os.PathLike[str] | None
) -> Dataset:
    """`raw` through `encoder`, read from the cache when the same source, tokenizer and settings were seen."""
    from datasets.fingerprint import Hasher

    fingerprint = Hasher.hash([raw._fingerprint, encoder.tokenizer, encoder.settings()])
    cache_file = None
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        cache_file = str(Path(cache_dir) / f"hf-{fingerprint}.arrow")
    return raw.map(
        encoder,
        batched=True,
        remove_columns=raw.column_names,
        new_fingerprint=fingerprint,
        cache_file_name=cache_file,
        desc=f"tokenising {split}",
    )


def _pack(tokenised: Dataset, seq_len: int) -> PackedDataset:
    """All texts' tokens (each ending in EOS) as one stream, cut into next-token windows of seq_len + 1."""
    column = tokenised.with_format("arrow")[:]["input_ids"]
    stream = np.concatenate([np.zeros(0, np.int64), *(chunk.flatten().to_numpy() for chunk in column.chunks)])
    return PackedDataset(torch.from_numpy(stream.astype(np.int32)), seq_len)


def _check_size(
    split: str, dataset: Dataset | PackedDataset, examples: int, batch_size: int, pack: bool
) -> None:
    """Refuse a split with too little data: training needs one full batch, validation one sample."""
    needed = batch_size if split == "train" else 1
    if len(dataset) < needed:
        unit = "examples with a target token"
        if pack:
            unit = "blocks of seq_len + 1 tokens" if isinstance(dataset, PackedDataset) else "packed rows"
        raise ValueError(
            f"{split} split too small: {examples} examples give {len(dataset)} {unit}; allowed: at least "
            f"{needed} (more data, or a smaller seq_len, batch_size or val_fraction)"
        )
