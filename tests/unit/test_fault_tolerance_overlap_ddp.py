"""The sum over the replica groups chained onto DDP's comm hook (trainer/fault_tolerance/overlap_ddp.py), in one
process: DDP over a 1-rank gloo group, and "the other groups" a 1-rank gloo group too (the sum of one is the
value itself), so with 2 groups armed `.grad` is half the plain gradient. Every bucket's sum goes out from the
backward, in bucket order; the strategy's own hook (a ChainableHook) keeps running under it and alone again
after `remove`; a second synced backward leaves the average to the after-backward path."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

pytest.importorskip("torchft")

from strategies.techniques.ddp.chain import ChainableHook  # noqa: E402
from trainer.fault_tolerance.group_calls import DirectSum  # noqa: E402
from trainer.fault_tolerance.overlap_ddp import OverlappedGroupAverage, ddp_to_chain  # noqa: E402


class _Manager:
    """torchft's manager as DirectSum asks it: participating, no error."""

    def __init__(self) -> None:
        self.error = None

    def errored(self):
        return self.error

    def is_participating(self) -> bool:
        return True

    def report_error(self, err: Exception) -> None:
        self.error = err


class _Counted(DirectSum):
    """DirectSum that records the size of each tensor it launches."""

    def __init__(self, manager, pg) -> None:
        super().__init__(manager, pg)
        self.sizes: list[int] = []

    def allreduce(self, tensor, reduce_op):
        self.sizes.append(tensor.numel())
        return super().allreduce(tensor, reduce_op)


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _ddp(hook=None) -> DistributedDataParallel:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 640), torch.nn.Tanh(), torch.nn.Linear(640, 640))
    # 1.6 MB of weights each: a bucket per layer (DDP's first buckets hold 1 MB)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1, gradient_as_bucket_view=True)
    if hook is not None:
        ddp.register_comm_hook(dist.group.WORLD, ChainableHook(hook))
    return ddp


def _backward(ddp: DistributedDataParallel) -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    ddp(x).pow(2).sum().backward()


def _plain_grads() -> list[torch.Tensor]:
    ddp = _ddp()
    _backward(ddp)
    return [p.grad.clone() for p in ddp.parameters()]


@pytest.mark.parametrize("hook", [None, default_hooks.fp16_compress_hook])
def test_every_bucket_is_summed_over_the_groups_from_the_backward(group, hook):
    expected = _plain_grads()
    ddp = _ddp(hook)
    direct = _Counted(_Manager(), dist.new_group([0], backend="gloo"))
    overlap = OverlappedGroupAverage(ddp, direct)
    _backward(ddp)  # unarmed: the group's mean alone; DDP's first step, in one bucket (rebuilt after it)
    assert direct.sizes == []
    ddp.zero_grad(set_to_none=True)
    overlap.arm(groups=2)
    _backward(ddp)
    # launched by the hooks before the backward returned: one per bucket, the whole model
    assert overlap.launched == len(direct.sizes) >= 2
    # (the last bucket, a short one, summed whole with 2 slots for quorum_every's flags: DDP's own all-reduce)
    slots = 2 if hook is None else 0
    assert sum(direct.sizes) == sum(p.numel() for p in ddp.parameters()) + slots
    assert overlap.finish(use=True)
    tolerance = 1e-3 if hook is not None else 1e-6  # fp16 compression rounds the group's sum
    for got, plain in zip((p.grad for p in ddp.parameters()), expected, strict=True):
        assert torch.allclose(got, plain / 2, rtol=tolerance, atol=tolerance)
    if hook is not None:  # the strategy's hook runs under the chain, and keeps its name for DDP's logs
        assert [h.__name__ for h, _ in ddp._comm_hooks] == ["fp16_compress_hook"]
    overlap.remove()  # the strategy's hook alone again: the group's mean, nothing over the groups
    ddp.zero_grad(set_to_none=True)
    launched = len(direct.sizes)
    _backward(ddp)
    assert len(direct.sizes) == launched
    for got, plain in zip((p.grad for p in ddp.parameters()), expected, strict=True):
        assert torch.allclose(got, plain, rtol=tolerance, atol=tolerance)


def test_the_rings_thread_sums_the_buckets_in_order_and_the_backward_the_last_one(group):
    ddp = _ddp()
    overlap = OverlappedGroupAverage(ddp, _Counted(_Manager(), dist.new_group([0], backend="gloo")))
    ran, ring_average, sum_first = [], overlap._ring_average, overlap._sum_first

    def ringed(buffer, out, index):
        ran.append((index, threading.current_thread().name))
        ring_average(buffer, out, index)

    def summed_first(buffer, out):
        ran.append(("last, summed first", threading.current_thread().name))
        sum_first(buffer, out)

    overlap._ring_average, overlap._sum_first = ringed, summed_first
    _backward(ddp)  # (DDP's first backward: one bucket, rebuilt after it)
    for _ in range(2):
        overlap.arm(groups=2)
        _backward(ddp)
        assert overlap.finish(use=True)
        # the backward's own thread sums the last bucket (41K gradients: whole over the groups, then over the
        # group), after the ring's thread has the others: the step's end waits for no hand-off
        assert ran == [(0, "trainer-group-ring"), ("last, summed first", threading.current_thread().name)]
        ran.clear()


def test_a_second_synced_backward_leaves_the_average_to_the_flat_path(group):
    ddp = _ddp()
    overlap = OverlappedGroupAverage(ddp, _Counted(_Manager(), dist.new_group([0], backend="gloo")))
    overlap.arm(groups=2)
    _backward(ddp)
    _backward(ddp)
    assert not overlap.finish(use=True)
    overlap.arm(groups=2)  # the next step starts afresh
    ddp.zero_grad(set_to_none=True)
    _backward(ddp)
    assert overlap.finish(use=True)


def test_a_comm_hook_that_is_not_the_strategys_keeps_the_flat_average(group):
    def trainer(ddp):
        strategy = SimpleNamespace(model=ddp, world_size=1, pipeline=None)
        return SimpleNamespace(strategy=strategy, module=ddp.module)

    assert ddp_to_chain(trainer(_ddp())) is not None
    assert ddp_to_chain(trainer(_ddp(default_hooks.allreduce_hook))) is not None  # the strategy's: chained
    foreign = _ddp()
    foreign.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)  # DDP takes no second hook
    assert ddp_to_chain(trainer(foreign)) is None
