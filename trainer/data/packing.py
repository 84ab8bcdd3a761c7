"""Packing: documents -> one token stream with EOS after each -> fixed-length next-token samples."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from trainer.data.tokenizer import Tokenizer


def pack_documents(documents: Iterable[str], tokenizer: Tokenizer) -> tuple[torch.Tensor, int]:
    """One int32 token stream (each document's ids, then EOS, so the model learns where documents end)
    and the number of documents in it."""
    eos = torch.tensor([tokenizer.eos_id], dtype=torch.int32)
    parts: list[torch.Tensor] = []
    for text in documents:
        parts += [torch.tensor(tokenizer.encode(text), dtype=torch.int32), eos]
    tokens = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
    return tokens, len(parts) // 2


class PackedDataset:
    """Next-token samples cut from one token stream in blocks of T+1 tokens that overlap by one.

    Block i is stream[i*T : i*T + T + 1]; its input_ids are block[:-1] and labels block[1:], so the labels
    of all blocks tile stream[1 : n*T + 1] exactly once. Only stream[0] (nothing precedes it) and the last
    (len(stream) - 1) % T tokens (`dropped_tokens`, fewer than T) are never a target.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, blocks: range | None = None) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} is invalid; allowed: an int >= 1")
        self.tokens = tokens
        self.seq_len = seq_len
        total = max(0, (len(tokens) - 1) // seq_len)
        self.blocks = range(total) if blocks is None else blocks
        self.dropped_tokens = max(0, len(tokens) - 1 - total * seq_len)
        self._window = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        sample = self.batch(torch.tensor([index]))
        return {key: value[0] for key, value in sample.items()}

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """Samples `indices` stacked: {"input_ids", "labels"}, each LongTensor[len(indices), T]."""
        starts = (indices + self.blocks.start) * self.seq_len
        window = self.tokens[starts[:, None] + self._window].long()  # [B, T+1]
        # Contiguous copies: callers may view(-1) them or mask labels in place without touching input_ids.
        return {"input_ids": window[:, :-1].contiguous(), "labels": window[:, 1:].contiguous()}

    def split(self, val_fraction: float) -> tuple[PackedDataset, PackedDataset]:
        """(train, validation): the last `val_fraction` of the blocks, rounded up so a positive fraction
        always gives validation data, is validation; no target token is in both."""
        num_val = math.ceil(len(self) * val_fraction)
        cut = self.blocks.stop - num_val
        train = PackedDataset(self.tokens, self.seq_len, range(self.blocks.start, cut))
        val = PackedDataset(self.tokens, self.seq_len, range(cut, self.blocks.stop))
        return train, val
