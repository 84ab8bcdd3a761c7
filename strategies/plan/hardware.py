"""What the planner assumes of the machines: a small table of devices and links (datasheet numbers, with
their sources), or the rates `trainer doctor` measured on the real world (a rates file). The step-time
model reads one `Hardware`: a device's achievable matmul rate, the links a group can span, and, when
measured, the bus bandwidth of each collective by message size.

Bandwidths are bus bandwidths in nccl-tests' sense (GB/s, GB = 1e9 bytes): the rate at which each rank
moves its share, so a collective of S bytes over n ranks takes S * factor / busbw, factor 2(n-1)/n for
an all-reduce and (n-1)/n for an all-gather, reduce-scatter or all-to-all.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Device:
    """One accelerator: its dense bf16 peak (no sparsity) and its memory."""

    name: str
    bf16_tflops: float
    memory_bytes: float
    # the share of the peak a training step's matmuls reach when nothing waits on communication: large
    # bf16 GEMMs reach 70-80% of peak in cuBLAS, a whole step (attention, norms, elementwise, the optimizer)
    # about half (TorchTitan's published Llama 3 8B on 8 H100 with FSDP and compile: ~40% MFU including
    # its communication; Megatron-LM's 175B-1T runs: 44-52%)
    achievable: float = 0.5
    fp32_ratio: float = 0.5  # fp32 matmuls run as TF32 at half the bf16 rate (the same datasheets)


@dataclass(frozen=True)
class Link:
    """A link a group of ranks can span, per GPU and direction: its nominal rate and the all-reduce bus
    bandwidth nccl-tests reaches on it."""

    name: str
    nominal_GBps: float
    busbw_GBps: float


# Sources: NVIDIA's datasheets (H100: "H100 Tensor Core GPU" datasheet, SXM column, 989 TFLOP/s bf16
# dense (1979 with sparsity); H200: "H200 Tensor Core GPU" datasheet, same compute, 141 GB HBM3e; B200:
# "HGX B200" datasheet, 2.25 PFLOP/s bf16 dense per GPU, 180 GB HBM3e; A100: "A100 Tensor Core GPU"
# datasheet, 312 TFLOP/s bf16 dense, 80 GB HBM2e).
DEVICES: dict[str, Device] = {
    "h100": Device("H100 SXM 80GB", 989.0, 80e9),
    "h200": Device("H200 SXM 141GB", 989.0, 141e9),
    "b200": Device("B200 180GB", 2250.0, 180e9),
    "a100": Device("A100 SXM 80GB", 312.0, 80e9),
}

# Sources: NVLink 3/4/5 at 600/900/1800 GB/s per GPU both directions together (NVIDIA's A100/H100/B200
# datasheets), i.e. 300/450/900 per direction; nccl-tests all_reduce_perf on a DGX H100 reaches ~360 GB/s
# busbw (80% of 450; NVIDIA's NCCL performance notes), the same share is assumed on NVLink 3 and 5. PCIe
# Gen5 x16: 64 GB/s per direction (PCI-SIG), ~80% reached. InfiniBand NDR 400 Gb/s = 50 GB/s per port and
# direction, one port per GPU (rail-optimised DGX SuperPOD, NVIDIA's reference architecture), ~90%
# reached by NCCL across nodes; RoCE at 400 GbE the same port rate, ~80% reached (congestion control).
LINKS: dict[str, Link] = {
    "nvlink3": Link("NVLink 3 (A100)", 300.0, 240.0),
    "nvlink4": Link("NVLink 4 (H100/H200)", 450.0, 360.0),
    "nvlink5": Link("NVLink 5 (B200)", 900.0, 720.0),
    "pcie5": Link("PCIe Gen5 x16", 64.0, 51.0),
    "ib-ndr": Link("InfiniBand NDR 400G, one NIC per GPU", 50.0, 45.0),
    "roce": Link("RoCE 400GbE, one NIC per GPU", 50.0, 40.0),
}
NVLINK_OF = {"h100": "nvlink4", "h200": "nvlink4", "b200": "nvlink5", "a100": "nvlink3"}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Rates:
    """What `trainer doctor` measured (the rates file): one rank's achieved matmul rate, each link's best
    all-reduce busbw, and per collective, mesh group and message size the busbw (GB/s)."""

    backend: str
    device: str
    world_size: int
    gpus_per_node: int
    matmul_tflops: float
    intra_busbw_GBps: float
    inter_busbw_GBps: float
    collectives: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str | Path) -> Rates:
        """The rates file at `path`; a one-line ValueError naming the missing or bad key."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(
                f"rates file {path}: {err}; allowed: the JSON `trainer doctor --out` writes"
            ) from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "rates") -> Rates:
        """Rates from the parsed rates mapping; a one-line ValueError naming the missing or bad key."""
        try:
            links = data["links"]
            collectives = {
                op: {
                    group: {int(size): float(bw) for size, bw in sizes.items()}
                    for group, sizes in groups.items()
                }
                for op, groups in data.get("collectives", {}).items()
            }
            return cls(
                backend=str(data["backend"]),
                device=str(data["device"]),
                world_size=int(data["world_size"]),
                gpus_per_node=int(data["gpus_per_node"]),
                matmul_tflops=float(data["matmul_tflops"]),
                intra_busbw_GBps=float(links["intra_node"]["busbw_GBps"]),
                # one machine has no inter-node link: its groups all run at the intra-node rate
                inter_busbw_GBps=float(
                    (links.get("inter_node") or {}).get("busbw_GBps") or links["intra_node"]["busbw_GBps"]
                ),
                collectives=collectives,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(
                f"{where}: {type(err).__name__} {err}; allowed: the JSON `trainer doctor --out` writes "
                "(backend, device, world_size, gpus_per_node, matmul_tflops, links, collectives)"
            ) from None

    def busbw(self, op: str, group: str, nbytes: float) -> float | None:
        """The measured busbw (GB/s) of `op` over `group` (else over the world) for a message of `nbytes`,
        interpolated in log(size) between measured sizes and held flat outside them; None if not measured."""
        groups = self.collectives.get(op, {})
        table = groups.get(group) or groups.get("world")
        if not table:
            return None
        sizes = sorted(table)
        if nbytes <= sizes[0]:
            return table[sizes[0]]
        if nbytes >= sizes[-1]:
            return table[sizes[-1]]
        i = bisect.bisect_left(sizes, nbytes)
        lo, hi = sizes[i - 1], sizes[i]
        t = (math.log(nbytes) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return table[lo] + t * (table[hi] - table[lo])


@dataclass(frozen=True)
class Hardware:
    """The machines of a run: the device, the link inside a node and the one between nodes, and how many
    devices a node holds; `rates` (measured) overrides the table's link rates where it has a value."""

    device: Device
    intra: Link
    inter: Link
    gpus_per_node: int
    rates: Rates | None = None

    @property
    def flops_per_s(self) -> float:
        """The matmul rate a step reaches on one device (FLOP/s): measured, else peak x achievable."""
        if self.rates is not None:
            return self.rates.matmul_tflops * 1e12
        return self.device.bf16_tflops * 1e12 * self.device.achievable

    def busbw(self, op: str, group: str, nbytes: float, inter_node: bool) -> float:
        """Bus bandwidth (bytes/s) of `op` over the ranks of `group`, whose ring crosses nodes or not."""
        measured = self.rates.busbw(op, group, nbytes) if self.rates is not None else None
        if measured is not None:
            return measured * GB
        return (self.inter if inter_node else self.intra).busbw_GBps * GB


def parse_bytes(text: str) -> float:
    """'80GB', '141 GB', '80GiB', '8e10' -> bytes (GB = 1e9, GiB = 2**30); a ValueError otherwise."""
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "tb": 1e12, "gb": 1e9, "mb": 1e6, "b": 1}
    s = str(text).strip().lower().replace(" ", "")
    for unit, scale in units.items():
        if s.endswith(unit):
            s, factor = s[: -len(unit)], scale
            break
    else:
        factor = 1
    try:
        value = float(s) * factor
    except ValueError:
        raise ValueError(
            f"memory size {text!r} is invalid; allowed: a number with GB, GiB, MB or TB"
        ) from None
    if value <= 0:
        raise ValueError(f"memory size {text!r} is invalid; allowed: a positive size")
    return value


def build_hardware(
    device: str = "h100",
    gpus_per_node: int = 8,
    link: str = "ib-ndr",
    intra_link: str | None = None,
    gpu_memory: float | None = None,
    rates: Rates | None = None,
) -> Hardware:
    """Hardware from the table's names ("h100", "ib-ndr"), the node's NVLink by default inside a node;
    `gpu_memory` (bytes) overrides the device's, `rates` the links' and the matmul rate."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is unknown; allowed: {', '.join(DEVICES)}")
    for name in (link, intra_link):
        if name is not None and name not in LINKS:
            raise ValueError(f"link {name!r} is unknown; allowed: {', '.join(LINKS)}")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node!r} is invalid; allowed: an int >= 1")
    dev = DEVICES[device]
    if gpu_memory is not None:
        dev = replace(dev, memory_bytes=gpu_memory)
    intra, inter = LINKS[intra_link or NVLINK_OF[device]], LINKS[link]
    if rates is not None:  # the measured link rates replace the table's
        intra = Link(f"measured {rates.backend} intra-node", intra.nominal_GBps, rates.intra_busbw_GBps)
        inter = Link(f"measured {rates.backend} inter-node", inter.nominal_GBps, rates.inter_busbw_GBps)
    return Hardware(dev, intra, inter, gpus_per_node, rates)


def measured_hardware(rates: Rates, memory_bytes: float, gpus_per_node: int | None = None) -> Hardware:
    """Hardware described by a rates file alone (e.g. the CPU processes `trainer doctor` measured), each
    device holding `memory_bytes`."""
    device = Device(f"measured {rates.device}", rates.matmul_tflops, memory_bytes, 1.0, fp32_ratio=1.0)
    intra = Link(f"measured {rates.backend} intra-node", rates.intra_busbw_GBps, rates.intra_busbw_GBps)
    inter = Link(f"measured {rates.backend} inter-node", rates.inter_busbw_GBps, rates.inter_busbw_GBps)
    return Hardware(device, intra, inter, gpus_per_node or rates.gpus_per_node, rates)


# A CPU process of a gloo job, when nothing was measured: one core's fp32 GEMM rate (AVX2/AVX-512 sgemm:
# 30-100 GFLOP/s; the whole step about half), gloo's TCP loopback ~1 GB/s busbw (trainer doctor measures both)
CPU_PROCESS = Device("CPU process (gloo)", 0.05, 0.0, achievable=0.5, fp32_ratio=1.0)
GLOO_LOOPBACK = Link("gloo TCP loopback", 1.0, 1.0)


def cpu_hardware(processes: int, memory_bytes: float) -> Hardware:
    """`processes` CPU processes on one host, each with `memory_bytes`, as an unmeasured gloo job."""
    return Hardware(replace(CPU_PROCESS, memory_bytes=memory_bytes), GLOO_LOOPBACK, GLOO_LOOPBACK, processes)


def describe(hardware: Hardware) -> str:
    """One line: the device, its memory and the two links."""
    return (
        f"{hardware.device.name} ({hardware.device.memory_bytes / GB:.0f} GB), {hardware.gpus_per_node} per node; "
        f"intra-node {hardware.intra.name} {hardware.intra.busbw_GBps:g} GB/s busbw, inter-node "
        f"{hardware.inter.name} {hardware.inter.busbw_GBps:g} GB/s"
    )
