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

PACKED = 1 << 17  # the longest slice (elements) sent with terms in one message: a copy of 0.5 MB in fp32


class Ring:
    """This process's place in `group`'s ring; `tag` keeps concurrent buckets' messages apart."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.size, self.rank = group, group.size(), group.rank()
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.staging: torch.Tensor | None = None  # a slice and terms sent, and received (`all_gather`)

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
            self._swap([(out, received, tag)])
            into.add_(received)
        return self.mine(buffer)

    def all_gather(self, buffer: torch.Tensor, tag: int, terms: torch.Tensor | None = None) -> None:
        """Every process's summed slice into every process's `buffer`, in place. `terms` (a few numbers of
        this process's, `buffer`'s dtype): summed over the group in place, each passed on around the ring
        with the slices (a message's cost here is mostly its receiver's wake-up: a slice of up to PACKED
        elements takes the terms into its own message, copied; a longer one's transfer hides the wake-up
        of theirs, on `tag` + 1)."""
        slices = self.slices(buffer)
        passing = terms.clone() if terms is not None else None
        for step in range(self.size - 1):
            out, into = slices[(self.rank + 1 - step) % self.size], slices[(self.rank - step) % self.size]
            if passing is None:
                self._swap([(out, into, tag)])
                continue
            k = passing.numel()
            if max(out.numel(), into.numel()) <= PACKED:
                sending, receiving = self._staging(out.numel() + k, into.numel() + k, buffer.dtype)
                torch.cat([out, passing], out=sending)
                self._swap([(sending, receiving, tag)])
                into.copy_(receiving[:-k])
                received = receiving[-k:].clone()
            else:
                received = torch.empty_like(passing)
                self._swap([(passing, received, tag + 1), (out, into, tag)])
            terms.add_(received)  # the previous process's own terms, then the ones it was passed
            passing = received

    def _staging(self, sending: int, receiving: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Two buffers of these lengths for a slice with terms, kept for the next call."""
        if self.staging is None or self.staging.numel() < sending + receiving or self.staging.dtype != dtype:
            self.staging = torch.empty(sending + receiving, dtype=dtype)
        return self.staging[:sending], self.staging[sending : sending + receiving]

    def _swap(self, swaps: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """Each (out, into, tag): `out` sent to the next process, `into` received from the previous one."""
        works = [dist.isend(out, self.next, group=self.group, tag=tag) for out, _, tag in swaps]
        works += [dist.irecv(into, self.prev, group=self.group, tag=tag) for _, into, tag in swaps]
        for work in works:
            work.wait()
