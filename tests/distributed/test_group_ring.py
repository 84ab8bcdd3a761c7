"""A bucket's sum over a group by the ring of point-to-point sends (trainer/fault_tolerance/ring.py), which a
fault-tolerant replica group of DDP processes takes in place of DDP's all-reduce: on 3 gloo processes, for
sizes that leave slices uneven or empty, every process's slice is the sum's and the gathered bucket is the
same on every process, equal to the group's all-reduce; terms passed along with the gathered slices are
summed over the group on every process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import call_ranks

pytestmark = pytest.mark.slow

WORLD = 3


def _rank(rank: int, port: int) -> None:
    from trainer.fault_tolerance.ring import PACKED, Ring

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank, world_size=WORLD
    )
    ring = Ring(dist.new_group(list(range(WORLD))))
    for i, n in enumerate((1, 2, 7, 1000, WORLD * PACKED + 5)):  # the last: terms in messages of their own
        torch.manual_seed(rank)
        bucket = torch.randn(n)
        summed = bucket.clone()
        dist.all_reduce(summed)
        spare = torch.empty(-(-n // WORLD))
        mine = ring.reduce_scatter(bucket, spare, tag=3 * i)
        assert torch.allclose(mine, ring.mine(summed), rtol=1e-5, atol=1e-6), (n, rank)
        # a few numbers of each process's go around with the slices: every process gets their sum
        terms = torch.tensor([float(rank), 1.0, 10.0**rank])
        ring.all_gather(bucket, tag=3 * i + 1, terms=terms)
        assert torch.allclose(bucket, summed, rtol=1e-5, atol=1e-6), (n, rank)
        assert terms.tolist() == [0.0 + 1 + 2, WORLD, 1.0 + 10 + 100], (n, rank, terms)
        everyone = [torch.empty_like(bucket) for _ in range(WORLD)]
        dist.all_gather(everyone, bucket)
        assert all(torch.equal(other, bucket) for other in everyone), (n, rank)  # the same bits everywhere
    dist.destroy_process_group()


def test_the_rings_reduce_scatter_and_all_gather_give_every_process_the_groups_sum():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # bound on a port it picks
    call_ranks(_rank, WORLD, store.port)
