"""`local_parts`: gradients as this rank's values, DTensors among them included (the per-step clip and token
scaling run on it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from strategies.gradients import scale_
from trainer.core.dtensors import local_parts


def test_plain_tensors_come_back_as_the_same_list_and_a_dtensor_as_its_local_shard():
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    plain = [torch.ones(2), torch.nn.Parameter(torch.ones(3))]
    assert local_parts(plain) is plain
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Shard(0)])
        parts = local_parts([plain[0], sharded])
        assert [type(t) for t in parts] == [torch.Tensor, torch.Tensor]
        scale_([sharded, plain[0]], torch.tensor(3.0))
        assert sharded.to_local().tolist() == [3.0] * 4 and plain[0].tolist() == [3.0, 3.0]
    finally:
        dist.destroy_process_group()
