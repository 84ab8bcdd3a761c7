"""The cross-group gradient average overlapped with the backward (trainer/fault_tolerance/overlap.py), against
a stand-in for torchft's manager whose all-reduce sums a bucket with a peer's zeros (the hooks copy the
gradients halved, for 2 groups):
buckets (DDP's) launch in order while the backward runs (the window's last backward, with accumulation),
unused parameters keep no gradient, and a backward more than armed for leaves the gradients to the
after-backward path."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import ReduceOp

pytest.importorskip("torchft")

from trainer.fault_tolerance.costs import PARTS, StepCosts  # noqa: E402
from trainer.fault_tolerance.overlap import BUCKET_BYTES, FIRST_BUCKET_BYTES, OverlappedAverage  # noqa: E402

ONE_EACH = {"bucket_bytes": 1, "first_bucket_bytes": 1}  # every parameter in a bucket of its own


class _Work:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> bool:
        return True


class _Manager:
    def __init__(self) -> None:
        self.launched: list[torch.Tensor] = []  # each bucket's buffer, in launch order
        self.during_backward = 0  # launches seen before the backward returned

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp) -> _Work:
        assert reduce_op == ReduceOp.SUM  # the buckets hold each group's share of the average
        self.launched.append(tensor)
        return _Work(tensor)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(2, 2)  # no gradient in the step (in the last bucket)
        self.frozen = torch.nn.Linear(2, 2).requires_grad_(False)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _model() -> _Model:
    torch.manual_seed(0)
    return _Model()


def _backward(model: torch.nn.Module) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()


def test_buckets_launch_in_order_during_the_backward_and_hold_the_averages():
    model, manager = _model(), _Manager()
    # one tensor each, in reverse parameter order
    overlap = OverlappedAverage(model, manager, **ONE_EACH)
    assert [b.params for b in overlap.buckets[:2]] == [[model.net[2].bias], [model.net[2].weight]]
    assert len(overlap.buckets) == 6
    reference = _model()
    _backward(reference)

    overlap.arm(2)
    _backward(model)
    launched_in_backward = len(manager.launched)
    assert overlap.finish(use=True)
    # the Sequential's buckets launched as their gradients arrived; the unused layer's only at the end
    assert launched_in_backward == 4  # the unused layer's two buckets wait for `finish`
    assert [t.data_ptr() for t in manager.launched] == [b.flat.data_ptr() for b in overlap.buckets]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad * 0.5)
    assert model.unused.weight.grad is None and model.frozen.weight.grad is None

    # unarmed (between steps): the hooks do nothing
    model.zero_grad(set_to_none=True)
    before = len(manager.launched)
    _backward(model)
    assert len(manager.launched) == before and not overlap.finish(use=True)
    overlap.remove()


def test_a_second_backward_or_a_token_weighted_step_leaves_the_gradients_alone():
    model, manager = _model(), _Manager()
    overlap = OverlappedAverage(model, manager, **ONE_EACH)
    overlap.arm(2)
    _backward(model)
    _backward(model)  # accumulates into gradients the first backward's hooks already copied
    grads = [p.grad.clone() for p in model.net[0].parameters()]
    assert not overlap.finish(use=True)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.net[0].parameters(), grads, strict=True))
    assert len(manager.launched) == len(overlap.buckets)  # every bucket still reduced once, in every group

    model.zero_grad(set_to_none=True)
    overlap.arm(2)
    _backward(model)
    grads = [p.grad.clone() for p in model.net[0].parameters()]
    assert not overlap.finish(use=False)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.net[0].parameters(), grads, strict=True))
    overlap.remove()


def test_a_step_counts_its_copies_and_all_reduce_in_the_replica_groups_costs():
    """What the bench prints per step: the hooks' copies into the buckets and the launches and waits of
    their all-reduces go to the group's running totals (the quorum and the vote are the group's own)."""
    model, manager, costs = _model(), _Manager(), StepCosts()
    assert costs.seconds == dict.fromkeys(PARTS, 0.0)
    overlap = OverlappedAverage(model, manager, **ONE_EACH, costs=costs)
    overlap.arm(2)
    _backward(model)
    after_backward = dict(costs.seconds)
    assert after_backward["copies"] > 0 and after_backward["allreduce"] > 0  # launched during the backward
    assert overlap.finish(use=True)
    assert costs.seconds["allreduce"] > after_backward["allreduce"]  # the waits
    assert costs.seconds["copies"] > after_backward["copies"]  # the averages handed back as .grad
    assert costs.seconds["quorum"] == costs.seconds["commit"] == 0.0
    overlap.remove()


@pytest.mark.parametrize(
    ("kwargs", "overlaps"),
    [
        ({}, True),
        ({"accumulate_grad_batches": 2}, True),  # launched in the window's last backward
        ({"precision": "16-mixed"}, True),  # copied unscaled
        ({"sharded": True}, False),  # FSDP: the gradients exist only after the group's reduce-scatter
    ],
)
def test_the_backward_launches_the_average_only_where_its_gradients_are_final(kwargs, overlaps):
    from trainer import Trainer
    from trainer.fault_tolerance import FaultTolerance
    from trainer.fault_tolerance.replica_group import _overlap_is_valid

    sharded = kwargs.pop("sharded", False)
    trainer = Trainer(fault_tolerance=FaultTolerance("127.0.0.1:29510", 0), **kwargs)
    trainer.module = _model()
    if sharded:  # a DTensor's mark
        trainer.module.net[0].weight.to_local = lambda: trainer.module.net[0].weight
    assert _overlap_is_valid(trainer) is overlaps


def test_buckets_are_the_ones_ddp_rebuilds_a_small_first_one_then_25_mb():
    """The buckets DDP's reducer uses after its first step (gradients in the order the backward produces them,
    a 1 MB first bucket, then 25 MB ones): the last layer goes out alone while the backward runs on, not
    in a 25 MB bucket that waits for most of the backward."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024), torch.nn.Linear(1024, 8)
    )
    overlap = OverlappedAverage(model, _Manager())
    ready_order = list(reversed(list(model.parameters())))
    ddp, _ = dist._compute_bucket_assignment_by_size(ready_order, [FIRST_BUCKET_BYTES, BUCKET_BYTES])
    by_index = [[ready_order[i] for i in bucket] for bucket in ddp]
    assert [b.params for b in overlap.buckets] == by_index
    assert overlap.buckets[0].params == [model[3].bias, model[3].weight, model[2].bias, model[2].weight]
    overlap.remove()


def test_with_accumulation_the_windows_last_backward_launches_the_buckets():
    """Armed for 2 backwards: the first launches nothing (its gradients are not final), the second launches
    the buckets as it goes, and the averages are of the accumulated gradients. A window cut short (one
    backward: the epoch's last) launches them in `finish` with what was accumulated; a third backward marks
    the step stale."""
    model, manager = _model(), _Manager()
    overlap = OverlappedAverage(model, manager, **ONE_EACH)
    reference = _model()
    _backward(reference)
    _backward(reference)

    overlap.arm(2, 2)
    _backward(model)
    assert manager.launched == []
    _backward(model)
    assert len(manager.launched) == 4
    assert overlap.finish(use=True)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad * 0.5)

    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    _backward(reference)
    overlap.arm(2, 2)
    _backward(model)
    assert len(manager.launched) == 6
    assert overlap.finish(use=True)
    assert len(manager.launched) == 12
    for p, q in zip(model.net.parameters(), reference.net.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad * 0.5)

    model.zero_grad(set_to_none=True)
    overlap.arm(2, 2)
    for _ in range(3):
        _backward(model)
    assert not overlap.finish(use=True)
    overlap.remove()


def test_fp16_gradients_are_copied_unscaled_and_a_short_windows_with_what_undoes_the_normalization():
    """With fp16's scaler the hooks copy a gradient x 1/scale (what the scaler's unscale_ gives); a gradient
    the hooks did not copy (an earlier micro-batch's only) is copied in `finish` x `undo`."""
    model, manager = _model(), _Manager()
    overlap = OverlappedAverage(model, manager, **ONE_EACH)
    reference = _model()
    _backward(reference)

    overlap.arm(2, 1, inv_scale=0.25)
    _backward(model)
    assert overlap.finish(use=True)
    for p, q in zip(model.net.parameters(), reference.net.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad * 0.25 * 0.5)

    model.zero_grad(set_to_none=True)
    overlap.arm(2, 2)
    _backward(model)  # the window's only backward: no gradient is final in the hooks
    assert manager.launched[6:] == []
    for p in model.net.parameters():
        p.grad.div_(4.0)  # the loop's normalization after the backward (a token count of 4)
    assert overlap.finish(use=True, undo=4.0)
    for p, q in zip(model.net.parameters(), reference.net.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad * 0.5)
    overlap.remove()


def test_the_direct_sum_does_what_torchfts_allreduce_does_around_the_collective():
    """`DirectSum` (the buckets' collective straight on torchft's process group): nothing launched after a
    recorded failure, zeros sent by a group that does not participate, a failure at launch or at the wait
    recorded for the commit (the step is discarded), never raised."""
    from trainer.fault_tolerance.group_calls import DirectSum

    class Manager:
        def __init__(self, participating: bool = True, errored: Exception | None = None) -> None:
            self.participating, self.error, self.reported = participating, errored, []

        def errored(self):
            return self.error

        def is_participating(self) -> bool:
            return self.participating

        def report_error(self, err: Exception) -> None:
            self.reported.append(err)

    class Work:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def wait(self) -> bool:
            if self.fails:
                raise RuntimeError("the peer closed the connection")
            return True

    class PG:
        def __init__(self, launch_fails: bool = False, wait_fails: bool = False) -> None:
            self.launch_fails, self.wait_fails, self.calls = launch_fails, wait_fails, []

        def allreduce(self, tensors, options):
            self.calls.append((tensors[0].clone(), options.reduceOp))
            if self.launch_fails:
                raise RuntimeError("no connection")
            return Work(self.wait_fails)

    manager, pg = Manager(), PG()
    assert DirectSum(manager, pg).allreduce(torch.ones(3), ReduceOp.SUM).wait()
    assert torch.equal(pg.calls[0][0], torch.ones(3)) and pg.calls[0][1] == ReduceOp.SUM
    assert manager.reported == []

    manager, pg = Manager(participating=False), PG()
    tensor = torch.ones(3)
    assert DirectSum(manager, pg).allreduce(tensor, ReduceOp.SUM).wait()
    assert torch.equal(tensor, torch.zeros(3)) and torch.equal(pg.calls[0][0], torch.zeros(3))

    manager, pg = Manager(errored=RuntimeError("earlier")), PG()
    assert not DirectSum(manager, pg).allreduce(torch.ones(3), ReduceOp.SUM).wait()
    assert pg.calls == [] and manager.reported == []

    for pg in (PG(launch_fails=True), PG(wait_fails=True)):
        manager = Manager()
        assert not DirectSum(manager, pg).allreduce(torch.ones(3), ReduceOp.SUM).wait()
        assert len(manager.reported) == 1


def test_the_token_count_is_summed_after_the_last_bucket_and_before_the_waits():
    """`finish(extra=...)`: the step's token count goes to the groups right after the last bucket (the same
    order in every group), its round trip under the buckets' waits, not after them."""

    class Work(_Work):
        def __init__(self, tensor: torch.Tensor, events: list[str]) -> None:
            super().__init__(tensor)
            self.events = events

        def wait(self) -> bool:
            self.events.append(f"wait {len(self.tensor)}")
            return True

    class Manager(_Manager):
        def __init__(self) -> None:
            super().__init__()
            self.events: list[str] = []

        def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp) -> Work:
            super().allreduce(tensor, reduce_op)
            self.events.append(f"launch {len(tensor)}")
            return Work(tensor, self.events)

    model, manager = _model(), Manager()
    overlap = OverlappedAverage(model, manager, **ONE_EACH)
    overlap.arm(2)
    _backward(model)
    tokens = torch.tensor([7.0], dtype=torch.float64)
    assert overlap.finish(use=True, extra=tokens)
    assert manager.launched[-1] is tokens and len(manager.launched) == len(overlap.buckets) + 1
    first_wait = next(i for i, e in enumerate(manager.events) if e.startswith("wait"))
    assert manager.events[first_wait - 1] == "launch 1" and manager.events[-1] == "wait 1"
    overlap.remove()
