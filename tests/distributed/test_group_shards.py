"""GroupShards (trainer/fault_tolerance/group_shards.py) on 3 gloo ranks: a flat buffer's sum over the group as
each rank's shard (the first `numel % 3` ranks' one longer, a rank with none when the buffer is shorter than
the group), times a factor, and the shards gathered back into every rank's buffer, equal to the all-reduce;
several buffers in flight at once, gathered out of their scatter order."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import call_ranks

pytestmark = pytest.mark.slow

WORLD = 3
SIZES = (10, 9, 2, 1)  # 10 = 4 + 3 + 3; 2: the last rank's shard is empty


def _run_rank(rank: int, port: int) -> None:
    from trainer.fault_tolerance.group_shards import GroupShards

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        shards = GroupShards(dist.group.WORLD)
        assert shards.sizes(10) == [4, 3, 3] and shards.sizes(2) == [1, 1, 0]
        flats = [torch.randn(n, generator=torch.Generator().manual_seed(rank * 100 + n)) for n in SIZES]
        expected = []
        for flat in flats:
            total = flat.clone()
            dist.all_reduce(total)
            expected.append(total * 0.5)
        futures = [shards.scatter(flat, 0.5) for flat in flats]  # all in flight before any is waited for
        summed = [f.wait() for f in futures]
        for flat, shard, want in zip(flats, summed, expected, strict=True):
            start = sum(shards.sizes(flat.numel())[:rank])
            assert torch.allclose(shard, want[start : start + shard.numel()], rtol=0, atol=1e-6)
        # the gathers go out in reverse: every rank launches them in the same order on their own group
        gathers = [shards.gather(s, f) for s, f in reversed(list(zip(summed, flats, strict=True)))]
        for g in gathers:
            g.wait()
        for flat, want in zip(flats, expected, strict=True):
            assert torch.allclose(flat, want, rtol=0, atol=1e-6), (flat, want)
    finally:
        dist.destroy_process_group()


def test_a_buffers_shards_summed_over_the_group_and_gathered_back_equal_its_all_reduce():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # bound on a port it picks
    call_ranks(_run_rank, WORLD, store.port)
