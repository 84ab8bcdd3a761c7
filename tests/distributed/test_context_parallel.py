"""Context parallelism: load-balanced positions, refused lengths, and attention over real gloo groups that
matches single-process causal attention on the whole sequence, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import call_ranks

from strategies.techniques.cp.attention import ContextParallel, check_sequence, load_balanced_positions

B, HQ, HKV, T, D = 2, 4, 2, 16, 8  # GQA: two query heads per key/value head
ATOL = 1e-5


# ---- positions and refused lengths, no process group ------------------------------------------------------
def test_each_rank_holds_an_early_and_the_mirrored_late_chunk():
    assert load_balanced_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert load_balanced_positions(16, 3, 4).tolist() == [6, 7, 8, 9]
    assert ContextParallel(None, 0, 1).positions(5).tolist() == [0, 1, 2, 3, 4]


def test_a_length_that_does_not_split_into_2_cp_chunks_is_refused():
    """(`shard` itself is refused on a real group, in _run_rank.)"""
    with pytest.raises(
        ValueError, match=r"sequence length 12 does not split over cp=4; allowed: a multiple of 2\*cp = 8"
    ):
        load_balanced_positions(12, 0, 4)
    with pytest.raises(ValueError, match="cp size 2 needs a process group"):
        ContextParallel(None, 0, 2)


def test_check_sequence_names_seq_len_cp_tp_and_the_multiple():
    check_sequence(16, cp=2, tp=2)
    check_sequence(6, cp=1, tp=3)  # no load balancing with one cp rank: only tp's shards count
    with pytest.raises(
        ValueError, match=r"seq_len=12 does not fit cp=2, tp=2; allowed: a multiple of 2\*cp\*tp = 8 "
    ):
        check_sequence(12, cp=2, tp=2)
    with pytest.raises(
        ValueError, match="seq_len=7 does not fit cp=1, tp=2; allowed: a multiple of tp = 2"
    ) as err:
        check_sequence(7, cp=1, tp=2)
    assert "\n" not in str(err.value)


def test_one_rank_is_plain_causal_attention_and_attention_needs_the_matching_sequence_length():
    q, k, v, _ = _data()
    cp = ContextParallel(None, 0, 1)
    with pytest.raises(RuntimeError, match="call shard or set_sequence"):
        cp.attention(q, k, v)
    got = cp.attention(cp.shard(q, 2), cp.shard(k, 2), cp.shard(v, 2))
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    cp.set_sequence(8)  # a length that does not match the tensors: named, instead of a wrong mask
    with pytest.raises(ValueError, match="attention got 16 local positions but a sequence of 8 over cp=1"):
        cp.attention(q, k, v)


# ---- real process groups ------------------------------------------------------------------------------------
def _data(seq_len: int = T) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output's weights in the loss, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    shapes = ((B, HQ, seq_len, D), (B, HKV, seq_len, D), (B, HKV, seq_len, D), (B, HQ, seq_len, D))
    return tuple(torch.randn(s, generator=g) for s in shapes)


def _reference(seq_len: int) -> tuple[torch.Tensor, ...]:
    """Single-process causal SDPA on the whole sequence: the output and the gradients of q, k, v."""
    q, k, v, w = (t.requires_grad_(i < 3) for i, t in enumerate(_data(seq_len)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _reassemble(local: torch.Tensor, positions: torch.Tensor, group, size: int) -> torch.Tensor:
    """The full-sequence tensor from every rank's shard along dim 2, each put back at its positions."""
    pieces = [torch.empty_like(local) for _ in range(size)]
    where = [torch.empty_like(positions) for _ in range(size)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    dist.all_gather(where, positions, group=group)
    full = torch.full((*local.shape[:2], local.size(2) * size, local.size(3)), float("nan"))
    return full.index_copy(2, torch.cat(where), torch.cat(pieces, dim=2))  # a position nobody held stays NaN


def _check_cp(rank: int, world_rank: int, cp: ContextParallel, seq_len: int) -> list[str]:
    """One forward and backward of the sharded attention; what differs from the reference, by name."""
    q, k, v, w = (cp.shard(t, dim=2) for t in _data(seq_len))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = cp.attention(q, k, v)
    (out * w).sum().backward()  # each rank's share of the loss: the shares sum to the reference loss
    positions = cp.positions(seq_len)
    wrong = []
    for name, got, want in zip(
        ("output", "q.grad", "k.grad", "v.grad"),
        (out.detach(), q.grad, k.grad, v.grad),
        _reference(seq_len),
        strict=True,
    ):
        full = _reassemble(got, positions, cp.group, cp.size)
        diff = (full - want).abs().max().item()  # NaN (a missing position) fails too
        if not diff <= ATOL:
            wrong.append(
                f"rank {world_rank} (cp rank {rank} of {cp.size}, T={seq_len}) {name} differs by {diff:.2e}"
            )
    return wrong


def _run_rank(world_rank: int, world: int, port: int) -> None:
    """cp=4 over the whole world, then cp=2 over the subgroups [0, 1] and [2, 3] (group ranks that are not
    world ranks), each at two sequence lengths so a stale length would show."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=world_rank, world_size=world)
    try:
        wrong = []
        for seq_len in (T, 8):
            wrong += _check_cp(
                world_rank, world_rank, ContextParallel(dist.group.WORLD, world_rank, world), seq_len
            )
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank must create every group
        half = ContextParallel(halves[world_rank // 2], world_rank % 2, 2)
        with pytest.raises(
            ValueError, match=r"sequence length 6 does not split over cp=2; allowed: a multiple of 2\*cp = 4"
        ):
            half.shard(torch.zeros(B, 6), dim=1)
        for seq_len in (T, 4):
            wrong += _check_cp(world_rank % 2, world_rank, half, seq_len)
        assert not wrong, "; ".join(wrong)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_attention_over_gloo_matches_full_sequence_causal_attention():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # bound on a port it picks
    call_ranks(_run_rank, 4, 4, store.port)
