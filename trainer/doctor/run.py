"""The doctor's run: join (or start) the world as a fit does, measure, and bring every node's findings to
rank zero, which reports them."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from strategies.mesh import MeshStrategy
from strategies.parallel_dims import ParallelDims
from trainer.core.launch import detect_world
from trainer.core.precision import Precision
from trainer.doctor import hints, measure, nominal
from trainer.doctor.busbw import check_sizes, parse_size
from trainer.doctor.groups import (
    INTER,
    INTRA,
    GroupLayout,
    check_gpus_per_node,
    mesh_layouts,
    node_layouts,
    parse_mesh,
)
from trainer.doctor.report import Findings, NodeReport, rates_file, text_report
from trainer.doctor.sharded_overhead import ROUNDS, sharded_overhead
from trainer.doctor.topology import NodeProbe, load_nvml

# the smallest size is latency-bound: the planner reads each collective's fixed cost from it
DEFAULT_SIZES = {"gloo": "4K,64K,1M,8M", "nccl": "64K,1M,16M,128M,1G"}
DEFAULT_CALLS = {"gloo": (2, 5), "nccl": (5, 20)}  # (warm-up, timed) calls per size
# nccl-tests runs 5 + 20; more than this per size measures nothing new and keeps the job for hours
MAX_CALLS = 10_000
# (n x n sizes, dtype, timed calls at the largest size); the largest is the rate the report leads with
MATMUL = {
    "cpu": ((64, 128, 256, 512, 1024), torch.float32, 5),
    "cuda": ((1024, 2048, 4096, 8192), torch.bfloat16, 20),
}


@dataclasses.dataclass(frozen=True)
class DoctorOptions:
    """The command's options; None: the default for the backend or the world."""

    devices: int | None = None
    sizes: str | None = None
    mesh: str | None = None
    gpus_per_node: int | None = None
    warmup: int | None = None
    iters: int | None = None
    rounds: int | None = None
    out: Path | None = None


class _WorldStrategy(MeshStrategy):
    """The world the doctor measures, with the named groups of `dims`."""

    def __init__(self, dims: ParallelDims | None) -> None:
        super().__init__()
        self.dims = dims

    def parallel_dims(self) -> ParallelDims:
        return self.dims if self.dims is not None else super().parallel_dims()


def doctor(options: DoctorOptions) -> str | None:
    """Run the doctor in every process of the world (started here if none is running): rank zero's report,
    None on the other ranks. Bad options raise a one-line ValueError before any process starts."""
    cuda = torch.cuda.is_available()
    world = detect_world()
    devices = options.devices
    if world is not None:
        devices = world.local_world_size if devices is None else devices
        num_nodes = max(world.world_size // max(world.local_world_size, 1), 1)
    else:
        devices = (torch.cuda.device_count() if cuda else 2) if devices is None else devices
        num_nodes = 1
    least = 2 if num_nodes == 1 else 1  # a collective needs peers: on one node, two processes
    if devices < least:
        raise ValueError(
            f"--devices {devices} is invalid; allowed: {least} or more processes (a collective needs peers)"
        )
    strategy = _WorldStrategy(parse_mesh(options.mesh) if options.mesh else None)
    # checks the mesh against the world too
    strategy.configure("cuda" if cuda else "cpu", devices, num_nodes, Precision("32"))
    backend = "nccl" if cuda else "gloo"
    sizes = [parse_size(s) for s in (options.sizes or DEFAULT_SIZES[backend]).split(",") if s.strip()]
    check_sizes(sizes, _memory_per_process(cuda, devices))
    for name, least in (("warmup", 0), ("iters", 1), ("rounds", 1)):
        value = getattr(options, name)
        if value is not None and not least <= value <= MAX_CALLS:
            raise ValueError(f"--{name} {value} is invalid; allowed: an int from {least} to {MAX_CALLS}")
    gpus_per_node = devices if options.gpus_per_node is None else options.gpus_per_node
    check_gpus_per_node(gpus_per_node, devices * num_nodes)
    return strategy.launch(_run, strategy, options, sizes)


def _memory_per_process(cuda: bool, devices: int) -> int:
    """Bytes one rank may fill with its message buffers: a GPU's memory, or the host's shared by the
    node's processes."""
    if cuda:
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // devices


def _run(strategy: _WorldStrategy, options: DoctorOptions, sizes: list[int]) -> str | None:
    """In every rank: measure, gather each node's GPU side, and (rank zero) write the report."""
    strategy.setup_environment()
    world, device = strategy.world, strategy.root_device
    backend = dist.get_backend()
    warmup, iters = (
        options.warmup if options.warmup is not None else DEFAULT_CALLS[backend][0],
        options.iters or DEFAULT_CALLS[backend][1],
    )
    gpus_per_node = options.gpus_per_node or world.local_world_size
    whole = GroupLayout("world", (tuple(range(world.world_size)),))
    split, dims = node_layouts(world.world_size, gpus_per_node), mesh_layouts(strategy.mesh.dims)
    groups = {"world": dist.group.WORLD, **measure.make_groups(split)}
    groups |= {layout.name: strategy.mesh.group(layout.name) for layout in dims}
    layouts = [whole, *split, *dims]

    nvml, probe, why = None, None, "gloo on the CPU"
    local_zero = world.rank % gpus_per_node == 0  # one rank per node reads the node
    if device.type == "cuda" and local_zero:
        nvml, why = load_nvml()
        try:  # before the collectives: XIDs are seen from here
            probe = None if nvml is None else NodeProbe(nvml, socket.gethostname())
        except nvml.NVMLError as err:  # no driver, no permission: the rest of the doctor still runs
            why = f"NVML did not start: {err}"

    measurements = measure.measure_collectives(layouts, groups, sizes, device, warmup, iters)
    sizes_mm, dtype, calls = MATMUL[device.type]
    by_size, together = measure.matmul_alone_and_together(device, sizes_mm, dtype, calls)
    together = together[:gpus_per_node]  # node 0's ranks
    n = max(sizes_mm)
    rounds = options.rounds or ROUNDS
    sharded = sharded_overhead(device, rounds)

    node = None
    if local_zero:
        topology = None
        try:
            topology = probe.read() if probe is not None else None
        except nvml.NVMLError as err:
            why = f"NVML could not read this node's GPUs: {err}"
        facts = hints.node_facts(
            nvlink=topology is not None and topology.nvlink,
            gpus=len(topology.gpus) if topology is not None else None,
            local_ranks=gpus_per_node,
            nodes=world.world_size // gpus_per_node,
        )
        node = NodeReport(socket.gethostname(), topology, why, hints.env_hints(os.environ, facts))
    nodes = [found for found in strategy.all_gather_object(node, group="world") if found is not None]
    if world.rank != 0:
        return None
    findings = Findings(
        backend=backend,
        device=device.type,
        world_size=world.world_size,
        gpus_per_node=gpus_per_node,
        warmup=warmup,
        iters=iters,
        matmul_tflops=by_size[n],
        matmul_what=f"{n}x{n} {str(dtype).removeprefix('torch.')}, {calls} calls",
        matmul_by_size=by_size,
        matmul_together_tflops=sum(together) / len(together),
        host_cores=len(os.sched_getaffinity(0)) if device.type == "cpu" else None,
        sharded=sharded,
        sharded_rounds=rounds,
        measurements=measurements,
        nominal=_nominal(layouts, gpus_per_node, backend, nodes),
        nodes=nodes,
    )
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(rates_file(findings), indent=2) + "\n")
    return text_report(findings) + (f"\n\nwrote {options.out}" if options.out is not None else "")


def _nominal(
    layouts: list[GroupLayout], gpus_per_node: int, backend: str, nodes: list[NodeReport]
) -> dict[str, nominal.LinkRate]:
    """Each layout's link: between nodes if one of its groups spans two, else within the node (rank 0's)."""
    topology = nodes[0].topology if nodes else None
    intra = nominal.intra_node_rate(topology, backend)
    inter = nominal.inter_node_rate(backend, gpus_per_node)
    rates = {}
    for layout in layouts:
        spans = any(len({r // gpus_per_node for r in ranks}) > 1 for ranks in layout.groups)
        rates[layout.name] = inter if layout.name == INTER or (spans and layout.name != INTRA) else intra
    return rates
