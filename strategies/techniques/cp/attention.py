"""Context parallelism: exact causal attention with the sequence sharded over a "cp" process group.

This is the all-gather form Llama 3 used: every rank keeps its own queries and gathers the keys and
values of the whole sequence, then attends with a mask built from global positions. It costs one
all-gather of K and V per attention call (and a reduce-scatter of their gradients), and, unlike ring
attention, needs nothing beyond a plain collective, so it runs on gloo. torch's own `context_parallel`
only intercepts the CUDA SDPA kernels and fails on the CPU.

Load balancing: under a causal mask, late positions attend to many more keys than early ones, so a
contiguous split would leave the last rank with most of the work. The sequence is cut into 2*cp
chunks and rank r holds chunk r and chunk 2*cp-1-r, pairing a cheap chunk with an expensive one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F


def load_balanced_positions(seq_len: int, rank: int, size: int, device=None) -> torch.Tensor:
    """The global positions (LongTensor [seq_len // size]) rank `rank` of `size` holds: chunk `rank` then
    chunk 2*size-1-rank of 2*size equal chunks; with size 1, the whole sequence in order."""
    if size == 1:  # one rank has nothing to balance: any length works, as check_sequence allows
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * size):
        raise ValueError(
            f"sequence length {seq_len} does not split over cp={size}; "
            f"allowed: a multiple of 2*cp = {2 * size} (two load-balanced chunks per rank)"
        )
    chunk = seq_len // (2 * size)
    offsets = torch.arange(chunk, device=device)
    return torch.cat((rank * chunk + offsets, (2 * size - 1 - rank) * chunk + offsets))


def check_sequence(seq_len: int, cp: int, tp: int = 1) -> None:
    """Raise a one-line ValueError unless `seq_len` splits into cp's load-balanced chunks and then into
    tp's sequence-parallel shards (checked before spawning, where the recipe is read)."""
    if cp == 1:
        if seq_len % tp:
            raise ValueError(
                f"seq_len={seq_len} does not fit cp={cp}, tp={tp}; "
                f"allowed: a multiple of tp = {tp} (sequence-parallel shards)"
            )
        return
    multiple = 2 * cp * tp
    if seq_len % multiple:
        raise ValueError(
            f"seq_len={seq_len} does not fit cp={cp}, tp={tp}; allowed: a multiple of 2*cp*tp = {multiple} "
            "(load-balanced chunks, sequence-parallel shards)"
        )


class ContextParallel:
    """Shards sequences over the cp group in the load-balanced order and computes exact causal attention."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        """`rank` is this process's index within `group` (the order the all-gather concatenates in);
        `group` may be None when `size` is 1."""
        if size > 1 and group is None:
            raise ValueError(f"cp size {size} needs a process group; allowed without one: size 1")
        self.group, self.rank, self.size = group, rank, size
        self.seq_len: int | None = None  # of the current batch: what `attention` builds its mask from

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        """The global positions (LongTensor [seq_len // size]) this rank holds, e.g. for RoPE."""
        return load_balanced_positions(seq_len, self.rank, self.size, device)

    def set_sequence(self, seq_len: int) -> None:
        """Declare the full sequence length of the batch the next `attention` calls belong to."""
        self.positions(seq_len)  # refuse a length that does not split here, not inside the model
        self.seq_len = seq_len

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of `tensor` along `dim`; also sets the sequence length `attention` uses."""
        seq_len = tensor.size(dim)
        self.set_sequence(seq_len)
        return tensor.index_select(dim, self.positions(seq_len, tensor.device))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Exact causal attention of this rank's queries q (B, Hq, T_local, D) over the whole sequence's
        keys, from every rank's k, v (B, Hkv, T_local, D); Hq a multiple of Hkv. Returns (B, Hq, T_local, D)."""
        if self.seq_len is None:
            raise RuntimeError(
                "ContextParallel.attention needs the sequence length: call shard or set_sequence"
            )
        q_pos = self.positions(self.seq_len, q.device)
        if q.size(2) != len(q_pos):
            raise ValueError(
                f"attention got {q.size(2)} local positions but a sequence of {self.seq_len} over cp={self.size} "
                f"gives {len(q_pos)} per rank; allowed: tensors sharded from the last shard/set_sequence length"
            )
        if self.size == 1:
            k_pos = q_pos
        else:
            # one collective for both: stacked K and V gathered along T. Its backward reduce-scatters (sums
            # over ranks, keeps this rank's slice), because every rank's queries read every rank's keys.
            # funcol's all_gather_single is differentiable and runs on gloo; torch.distributed.nn's
            # all_gather also works but is deprecated in favour of it.
            kv = funcol.all_gather_single(torch.stack((k, v)).contiguous(), 3, self.group)
            k, v = kv.unbind(0)
            # the gather concatenates in group-rank order, so no K/V reordering: the mask reads positions
            k_pos = torch.cat(
                [load_balanced_positions(self.seq_len, r, self.size, q.device) for r in range(self.size)]
            )
        causal = q_pos[:, None] >= k_pos[None, :]  # query at position p sees keys at positions <= p
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
