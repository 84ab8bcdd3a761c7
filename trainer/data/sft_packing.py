"""Packing SFT examples: several (input_ids, labels) examples per row of seq_len tokens, each keeping its
own positions, so a model that attends only within runs of consecutive positions sees each example as if
it were alone.

Unlike plain text (one stream cut anywhere, `PackedDataset`), an SFT example is never split and no label
crosses from one example into the next: its labels were shifted inside the example before packing. A row
is {"input_ids", "labels", "position_ids"} (LongTensor[T]) with no attention_mask: `position_ids` restart
at 0 at each example, which is what marks the boundaries (HFModule turns them into block-diagonal
attention, trainer.models.hf_packing). The rest of a row is padding (pad id, label -100) with positions
of its own, so it is a separate block too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IGNORE_INDEX = -100


class PackedExamples:
    """Rows of packed examples: {"input_ids", "labels", "position_ids"}, each LongTensor[T] (T = seq_len).

    Examples fill rows in order (next-fit: a row is closed when the next example does not fit), so every
    example is whole in exactly one row: example i lies in row `rows[i]` from column `starts[i]`."""

    def __init__(
        self, input_ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]], seq_len: int, pad_id: int
    ) -> None:
        if len(input_ids) != len(labels):
            raise ValueError(f"{len(input_ids)} input_ids but {len(labels)} labels; allowed: one per example")
        self.seq_len = seq_len
        self.rows: list[int] = []
        self.starts: list[int] = []
        row, filled = -1, seq_len  # no row open yet
        for ids, targets in zip(input_ids, labels, strict=True):
            n = len(ids)
            if not 1 <= n <= seq_len or len(targets) != n:
                raise ValueError(
                    f"an example of {n} tokens and {len(targets)} labels cannot be packed; allowed: "
                    f"1..seq_len={seq_len} tokens, one label each"
                )
            if filled + n > seq_len:  # next-fit: the example opens a new row
                row, filled = row + 1, 0
            self.rows.append(row)
            self.starts.append(filled)
            filled += n
        count = row + 1
        self.input_ids = torch.full((count, seq_len), pad_id, dtype=torch.long)
        self.labels = torch.full((count, seq_len), IGNORE_INDEX, dtype=torch.long)
        self.position_ids = torch.zeros((count, seq_len), dtype=torch.long)
        ends = [0] * count  # where each row's padding starts
        for ids, targets, row, start in zip(input_ids, labels, self.rows, self.starts, strict=True):
            n = len(ids)
            self.input_ids[row, start : start + n] = torch.as_tensor(ids, dtype=torch.long)
            self.labels[row, start : start + n] = torch.as_tensor(targets, dtype=torch.long)
            self.position_ids[row, start : start + n] = torch.arange(n)
            ends[row] = start + n
        for row, end in enumerate(ends):  # the padding: its own block, positions from 0
            self.position_ids[row, end:] = torch.arange(seq_len - end)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        return {
            "input_ids": self.input_ids[index],
            "labels": self.labels[index],
            "position_ids": self.position_ids[index],
        }
