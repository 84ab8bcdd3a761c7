"""Hugging Face rows tokenised per task (the Dataset.map function), cached, and texts packed into blocks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainer.data.packing import PackedDataset

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100  # a label no loss counts (cross_entropy's default ignore_index)
_CACHE_VERSION = 1  # bump when the tokenised columns change, so old cache files are not reused


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
