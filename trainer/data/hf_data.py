"""Hugging Face datasets -> (train, validation) torch DataLoaders for causal LM (plain text or SFT) and
classification, in the batch convention of `trainer.data`.

Loaders are plain DataLoaders over map-style datasets, so the framework's data-parallel sharding and
DP-SGD's Poisson sampling apply to them as to any user loader. Tokenisation runs once through
`Dataset.map` and is cached (see `hf_dataloaders`). Here: the loaders; their parts beside: reading and
splitting the data (hf_datasets.py), labels (hf_labels.py), tokenising and packing (hf_encoding.py),
padding batches (hf_collate.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader

from trainer.data.hf_collate import PadCollator, _pad_id, padding_id
from trainer.data.hf_datasets import _splits, _with_validation, load_hf_dataset
from trainer.data.hf_encoding import _Encoder, _pack, _tokenise
from trainer.data.hf_labels import _check_columns, _label_ids, class_names
from trainer.data.packing import PackedDataset
from trainer.data.rows import MESSAGES, TEXT, check_rows
from trainer.data.sft_packing import PackedExamples

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# the loaders' public names, importable from here as before hf_data.py was split
__all__ = ["class_names", "hf_dataloaders", "load_hf_dataset", "padding_id"]

TASKS = ("causal-lm", "seq-classification", "token-classification")


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
