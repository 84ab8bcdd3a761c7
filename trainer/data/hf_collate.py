"""Padding tokenised examples into batches: the pad id (the pad token, else EOS) and the collator."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainer.data.hf_encoding import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_WARNED_PAD: set[str] = set()  # tokenizers already warned about padding with EOS


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
