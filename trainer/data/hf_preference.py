"""Preference pairs -> DataLoaders for DPO (HFModule(task="dpo")): {"prompt", "chosen", "rejected"} records,
each response encoded after its prompt exactly as SFT encodes a prompt/response pair (hf_encoding.py).

A batch is {"chosen_input_ids", "chosen_attention_mask", "chosen_labels", "rejected_input_ids",
"rejected_attention_mask", "rejected_labels"}, LongTensor[B, T]: both halves padded to one width T (so the
policy scores both in one forward of 2B rows), labels already shifted with -100 on the prompt and padding.
The loaders shard, shuffle and split like `hf_dataloaders`' (a pair is one sample).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from trainer.data.hf_collate import PadCollator, _pad_id
from trainer.data.hf_data import _check_settings, _load_tokenizer, _loader
from trainer.data.hf_datasets import _splits, load_hf_dataset
from trainer.data.hf_encoding import _Encoder
from trainer.data.hf_labels import _check_columns
from trainer.data.rows import TEXT, check_rows

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict
    from transformers import PreTrainedTokenizerBase

_CACHE_VERSION = 1  # bump when the tokenised columns change, so old cache files are not reused
SIDES = ("chosen", "rejected")


def preference_dataloaders(
    data: str | os.PathLike[str] | Dataset | DatasetDict,
    tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase,
    *,
    seq_len: int = 512,
    batch_size: int = 8,
    val_fraction: float = 0.05,
    seed: int = 0,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
    cache_dir: str | os.PathLike[str] | None = None,
    skip_bad_rows: bool = False,
) -> tuple[DataLoader, DataLoader | None]:
    """(train, validation or None) DataLoaders of preference pairs: each side is the prompt then the
    response (through the tokenizer's chat template as one user/assistant exchange when it has one, else
    prompt tokens, response tokens, EOS), truncated to seq_len + 1 tokens; the response (and EOS) are the
    targets. A pair is dropped when either side keeps no response token. Splits, caching, shuffling and the
    check of each row (prompt, chosen and rejected strings; `skip_bad_rows`) as in `hf_dataloaders`."""
    _check_settings("causal-lm", seq_len, batch_size, val_fraction, None, None, None)  # the shared checks
    tok = _load_tokenizer(tokenizer)
    chat = getattr(tok, "chat_template", None) is not None
    if not chat and tok.eos_token_id is None:
        raise ValueError(
            "the tokenizer has no EOS token, which ends every response; allowed: a tokenizer with eos_token set"
        )
    if chat and not getattr(tok, "is_fast", False):
        raise ValueError(
            "a chat template needs token offsets to find the responses, which only fast tokenizers give; "
            "allowed: a fast tokenizer (one with a tokenizer.json)"
        )
    source = load_hf_dataset(data) if isinstance(data, (str, os.PathLike)) else data
    fields = [prompt_field, chosen_field, rejected_field]
    source = check_rows(source, dict.fromkeys(fields, TEXT), skip_bad_rows)
    train_raw, val_raw = _splits(source, val_fraction, seed)
    for raw in (train_raw, val_raw):
        if raw is not None:
            _check_columns(raw, fields, "dpo", "")
    encoder = PreferenceEncoder(tok, fields, seq_len, chat)
    collate = PreferenceCollator(_pad_id(tok))
    train = _loader("train", train_raw, encoder, cache_dir, batch_size, collate, seed)
    val = (
        None
        if val_raw is None
        else _loader("validation", val_raw, encoder, cache_dir, batch_size, collate, seed)
    )
    return train, val


class PreferenceEncoder:
    """The batched `Dataset.map` function: prompt/chosen/rejected columns -> each side's input_ids and
    shifted labels, through the SFT encoder's prompt/response encoding."""

    mode = "dpo"
    pack = False

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, fields: list[str], seq_len: int, chat: bool
    ) -> None:
        self.tokenizer, self.fields, self.seq_len, self.chat = tokenizer, fields, seq_len, chat
        self._sft = _Encoder(tokenizer, "sft", fields[:2], seq_len, pack=False, chat=chat)

    def settings(self) -> list[Any]:
        """What the tokenised columns depend on besides the source data and the tokenizer (the cache key)."""
        return [_CACHE_VERSION, self.mode, self.fields, self.seq_len, self.chat]

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {f"{side}_{key}": [] for side in SIDES for key in ("input_ids", "labels")}
        prompts, chosen, rejected = (batch[field] for field in self.fields)
        for prompt, *responses in zip(prompts, chosen, rejected, strict=True):
            encoded = [self._sft.example(prompt, response) for response in responses]
            if any(side is None for side in encoded):
                continue
            for side, (ids, labels) in zip(SIDES, encoded, strict=True):
                out[f"{side}_input_ids"].append(ids)
                out[f"{side}_labels"].append(labels)
        return out


class PreferenceCollator:
    """Pairs -> one batch whose chosen and rejected halves are padded together to the longest of either
    (pad id, label -100, attention_mask 0); a class so DataLoader workers can pickle it."""

    def __init__(self, pad_id: int) -> None:
        self._pad = PadCollator(pad_id)

    def __call__(self, pairs: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [
            {"input_ids": pair[f"{side}_input_ids"], "labels": pair[f"{side}_labels"]}
            for side in SIDES
            for pair in pairs
        ]
        padded = self._pad(rows)  # [2B, T]: the chosen rows, then the rejected ones
        n = len(pairs)
        return {
            f"{side}_{key}": value[i * n : (i + 1) * n]
            for i, side in enumerate(SIDES)
            for key, value in padded.items()
        }
