"""The norm of FSDP2's and HSDP's sharded gradients in one all-reduce of the shards' squared norms
(strategies/gradients.py `sharded_norm`, which ParallelStrategy's clipping and logging take and a fault-tolerant
group's commit vote rides): on real gloo meshes of 4 processes, the DTensor norm's bits, with uneven and empty
shards; other layouts are left to the DTensor norm."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import call_ranks

pytestmark = pytest.mark.slow

WORLD = 4
SHAPES = [(9, 5), (3,), (16, 16), (1, 7), (4,)]  # rows not a multiple of 4: uneven shards, empty ones


def _rank(rank: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from strategies.gradients import shard_group, sharded_norm

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the test process's
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    torch.manual_seed(0)  # every rank the same whole gradients
    whole = [torch.randn(shape) * 10 ** (i - 2) for i, shape in enumerate(SHAPES)]
    flat = init_device_mesh("cpu", (WORLD,))
    hybrid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for mesh, placements, ranks in [(flat, [Shard(0)], WORLD), (hybrid, [Replicate(), Shard(0)], 2)]:
        grads = [distribute_tensor(t, mesh, placements) for t in whole]
        group = shard_group(grads)
        assert group is not None and dist.get_world_size(group) == ranks, (mesh, group)
        extra = torch.tensor([float(rank), 1.0])
        got = sharded_norm(grads, group, extra)
        expected = torch.nn.utils.get_total_norm(grads, 2.0).full_tensor()
        assert torch.equal(got, expected), (mesh, got.item(), expected.item())  # the same bits
        assert got.item() == pytest.approx(torch.nn.utils.get_total_norm(whole, 2.0).item(), rel=1e-6)
        members = dist.get_process_group_ranks(group)
        assert extra.tolist() == [float(sum(members)), float(ranks)], (extra, members)
    sharded = [distribute_tensor(t, flat, [Shard(0)]) for t in whole]
    others = [
        [*sharded, distribute_tensor(torch.ones(4), flat, [Replicate()])],  # placements differ
        [*sharded, distribute_tensor(torch.ones(4, dtype=torch.float64), flat, [Shard(0)])],  # dtypes differ
        [distribute_tensor(t, hybrid, [Shard(0), Shard(1) if t.dim() > 1 else Shard(0)]) for t in whole[:1]],
        [*whole],  # plain tensors
        [],
    ]
    for grads in others:
        assert shard_group(grads) is None
    dist.destroy_process_group()


def test_the_sharded_norm_has_the_dtensor_norms_bits_on_flat_and_hybrid_meshes():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # bound on a port it picks
    call_ranks(_rank, WORLD, store.port)
