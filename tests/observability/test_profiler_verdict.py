"""The Profiler's verdict: the rule on given numbers (compute- vs communication-bound, which collective and
its share of the step), the collectives told apart by their trace names, the group named from the mesh, and
the verdict line of a 2-process DDP run on gloo, its ratio recomputed from the logged phases."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import SCRIPTS, read_metrics, run_ranks
from torch.autograd import DeviceType

from callbacks.profiler import collective_kind, collectives_breakdown, data_parallel_group, verdict
from strategies.parallel_dims import ParallelDims


def phases(forward: float, backward: float, optimizer: float, comm: float) -> dict[str, float]:
    return {"forward": forward, "backward": backward, "optimizer": optimizer, "data": 0.5, "comm": comm}


def test_communication_shorter_than_computation_is_compute_bound():
    # 12 ms in flight against 10 + 20 + 10 = 40 ms of computation
    assert (
        verdict(phases(10, 20, 10, 12), {"all-reduce": 12.0}, 45.0, "batch")
        == "comm/compute 0.30: compute-bound"
    )


def test_communication_longer_than_computation_names_the_longest_collective_and_its_share():
    by_kind = {"all-gather": 20.0, "reduce-scatter": 33.0, "other": 1.0}
    got = verdict(phases(5, 10, 5, 50), by_kind, 66.0, "dense")
    assert got == "comm/compute 2.50: communication-bound: the dense reduce-scatter takes 50% of the step"
    # exactly as long: no overlap can hide it either
    got = verdict(phases(10, 10, 0, 20), {"all-reduce": 20.0}, 25.0, None)
    assert got == "comm/compute 1.00: communication-bound: the all-reduce takes 80% of the step"


@pytest.mark.parametrize(
    "name, kind",
    [
        ("gloo:all_reduce", "all-reduce"),
        ("c10d::allreduce_", "all-reduce"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all-reduce"),
        ("c10d::_allgather_base_", "all-gather"),
        ("_c10d_functional::all_gather_into_tensor", "all-gather"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce-scatter"),
        ("c10d::_reduce_scatter_base_", "reduce-scatter"),
        ("c10d::alltoall_base_", "all-to-all"),
        ("ncclDevKernel_SendRecv", "send/recv"),
        ("c10d::broadcast_", "broadcast"),
        ("record_param_comms", "other"),
    ],
)
def test_collective_kinds(name, kind):
    assert collective_kind(name) == kind


def event(name: str, start: float, end: float, device: DeviceType = DeviceType.CPU) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device)


def test_collectives_breakdown_is_the_union_of_each_kinds_spans():
    events = [
        event("c10d::allreduce_", 100, 110),  # the launch, inside ...
        event("gloo:all_reduce", 100, 400),  # ... the backend's work: 300 us once
        event("gloo:all_reduce", 600, 700),
        event("gloo:all_gather", 350, 450),
        event("aten::mm", 0, 1000),  # compute
    ]
    assert collectives_breakdown(events, steps=2) == pytest.approx({"all-reduce": 0.2, "all-gather": 0.05})
    gpu = [
        event("nccl:all_reduce", 0, 500),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 100, 150, DeviceType.CUDA),
    ]
    assert collectives_breakdown(gpu, steps=1) == pytest.approx({"all-reduce": 0.05})  # the kernel's time


def test_the_group_is_named_when_the_mesh_has_only_one():
    def strategy(**dims):
        world = 1
        for v in dims.values():
            world *= v
        return SimpleNamespace(mesh=SimpleNamespace(dims=ParallelDims(**dims).resolve(world)))

    assert data_parallel_group(strategy(dp_replicate=2, dp_shard=1)) == "batch"  # DDP
    assert data_parallel_group(strategy(dp_shard=4)) == "batch"  # FSDP: batch and dense are the same ranks
    assert data_parallel_group(strategy(dp_shard=1, tp=2)) == "tp"
    assert data_parallel_group(strategy(dp_shard=2, tp=2)) is None  # two groups: the trace does not say which
    assert data_parallel_group(SimpleNamespace()) is None  # one process


@pytest.mark.slow
def test_two_ddp_ranks_print_the_verdict_with_the_measured_ratio(tmp_path: Path) -> None:
    root = tmp_path / "run"
    done = run_ranks(2, SCRIPTS / "profile_script.py", "--steps", "4", "--root", str(root), timeout=300)
    line = next(li for li in done.stderr.splitlines() if "Profiler: steps 3-4" in li)
    found = re.search(
        r"\| comm/compute (\d+\.\d\d): (compute-bound|communication-bound: the batch \S+ takes \d+% of the step) \|",
        line,
    )
    assert found, line
    logged = {
        key: read_metrics(root, f"profiler/{key}")[4]
        for key in ("forward_ms", "backward_ms", "optimizer_ms", "comm_ms")
    }
    ratio = logged["comm_ms"] / (logged["forward_ms"] + logged["backward_ms"] + logged["optimizer_ms"])
    assert logged["comm_ms"] > 0  # the gloo all-reduce was seen
    assert float(found.group(1)) == pytest.approx(ratio, abs=0.006)
    assert read_metrics(root, "profiler/comm_compute_ratio")[4] == pytest.approx(ratio)
    assert found.group(2).startswith("compute-bound") == (ratio < 1), line
