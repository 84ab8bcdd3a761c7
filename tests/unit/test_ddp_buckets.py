"""DDPStrategy leaves DDP's bucket sizes to DDP unless asked: its 1 MB first bucket lets the first all-reduce
start early in the backward (passing DDP's own 25 MB cap explicitly drops that rule: one bucket for a model
under 25 MB, whose all-reduce then waits for the whole backward)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from strategies import DDPStrategy
from strategies.techniques.ddp.apply import apply_ddp


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _bucket_bytes(strategy: DDPStrategy, group) -> list[int]:
    """The bucket sizes DDP rebuilt after its first backward, for a 2.1 MB MLP."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    ddp = apply_ddp(model, group, torch.device("cpu"), strategy.options.ddp_kwargs)
    for _ in range(3):  # DDP rebuilds its buckets at the second forward, in the order the first readied them
        ddp("forward", torch.randn(4, 256)).sum().backward()  # (DDP wraps a StepRunner of the module)
    return [int(b) for b in ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")]


def test_ddps_own_buckets_by_default_the_first_of_1_mb(group):
    sizes = _bucket_bytes(DDPStrategy(), group)
    assert len(sizes) == 2 and sum(sizes) == 525568 * 4, sizes  # the last layer's 1 MB, then the rest


def test_an_explicit_cap_caps_every_bucket_the_first_too(group):
    assert _bucket_bytes(DDPStrategy(bucket_cap_mb=25), group) == [525568 * 4]
    assert len(_bucket_bytes(DDPStrategy(bucket_cap_mb=1), group)) == 2
