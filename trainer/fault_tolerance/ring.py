"""A bucket's sum over the processes of one group as each process's slice of it (reduce-scatter), and the
slices back into every process's bucket (all-gather), by point-to-point sends around the group's ring: the
bucket crosses each link (g - 1) / g times each way, into one preallocated slice-sized buffer. On gloo,
whose own reduce-scatter and all-gather are slower than its all-reduce, this pair around the sum of one
slice over the replica groups moves what one all-reduce over every process moves, where the group's
all-reduce then the whole bucket's sum over the groups moved a third more (bench/fault_tolerance.py
--group-size 2)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Ring:
    """This process's place in `group`'s ring; `tag` keeps concurrent buckets' messages apart."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.size, self.rank = group, group.size(), group.rank()
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def slices(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """`buffer`'s slices, one per process of the group (the first ones longer by one where uneven)."""
        return list(torch.tensor_split(buffer, self.size))

    def mine(self, buffer: torch.Tensor) -> torch.Tensor:
        """The slice of `buffer` this process holds summed after `reduce_scatter`."""
        return self.slices(buffer)[(self.rank + 1) % self.size]

    def reduce_scatter(self, buffer: torch.Tensor, spare: torch.Tensor, tag: int) -> torch.Tensor:
        """Sum `buffer` over the group into this process's slice (`mine`) of it, in place; `spare`: a
        buffer of at least a slice's size. Every process adds the slices in the same ring order."""
        slices = self.slices(buffer)
        for step in range(self.size - 1):
            out = slices[(self.rank - step) % self.size]
            into = slices[(self.rank - step - 1) % self.size]
            received = spare[: into.numel()]
            self._swap(out, received, tag)
            into.add_(received)
        return self.mine(buffer)

    def all_gather(self, buffer: torch.Tensor, tag: int) -> None:
        """Every process's summed slice into every process's `buffer`, in place."""
        slices = self.slices(buffer)
        for step in range(self.size - 1):
            self._swap(
                slices[(self.rank + 1 - step) % self.size], slices[(self.rank - step) % self.size], tag
            )

    def _swap(self, out: torch.Tensor, into: torch.Tensor, tag: int) -> None:
        sent = dist.isend(out, self.next, group=self.group, tag=tag)
        dist.irecv(into, self.prev, group=self.group, tag=tag).wait()
        sent.wait()
