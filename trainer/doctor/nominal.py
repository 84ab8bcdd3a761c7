"""Nominal link rates, in GB/s per GPU per direction: what an all-reduce's busbw approaches on a healthy
link (nccl-tests' busbw is measured against the per-direction rate). On gloo over the CPU there is none.

Sources: NVIDIA's datasheets. NVLink: A100 12 links x 25 GB/s = 300 GB/s per direction (600 GB/s both);
H100/H200 18 links x 25 = 450 (900 both); B200 NVLink 5, 900 (1.8 TB/s both). PCIe x16: 8/16/32/64 GT/s
per lane for gen 3/4/5/6, 128b/130b coding. InfiniBand/RoCE: the port's rate in Gb/s, as the kernel reports
it in /sys/class/infiniband/*/ports/*/rate, shared by the node's GPUs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from trainer.doctor.topology import NodeTopology

NVLINK_GBPS = (("B200", 900.0), ("B100", 900.0), ("H200", 450.0), ("H100", 450.0), ("A100", 300.0))
PCIE_GT_PER_LANE = {3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
INFINIBAND = Path("/sys/class/infiniband")
GLOO = "no nominal rate: gloo moves tensors over TCP sockets through the CPU (loopback on one machine)"


@dataclasses.dataclass(frozen=True)
class LinkRate:
    """A nominal rate and what it is."""

    gbps: float | None  # GB/s per direction; None: not known
    what: str


def nvlink_rate(gpu_name: str) -> float | None:
    """Per-direction NVLink GB/s of a GPU called `gpu_name`; None if it is not in the table."""
    return next((rate for key, rate in NVLINK_GBPS if key in gpu_name.upper()), None)


def pcie_rate(gen: int | None, width: int | None) -> float | None:
    """Per-direction GB/s of a PCIe link of generation `gen` and `width` lanes."""
    if gen not in PCIE_GT_PER_LANE or not width:
        return None
    return PCIE_GT_PER_LANE[gen] * width * 128 / 130 / 8


def intra_node_rate(topology: NodeTopology | None, backend: str) -> LinkRate:
    """The link between GPUs of one node: NVLink where every pair has it, else the slowest PCIe link."""
    if backend == "gloo" or topology is None or not topology.gpus:
        return LinkRate(None, GLOO)
    name = topology.gpus[0].name
    if topology.nvlink and nvlink_rate(name) is not None:
        return LinkRate(nvlink_rate(name), f"NVLink of {name}")
    rates = [pcie_rate(g.pcie_gen, g.pcie_width) for g in topology.gpus]
    if topology.nvlink or None in rates:
        return LinkRate(None, f"no nominal rate: {name} is not in the table of trainer/doctor/nominal.py")
    slowest = min(topology.gpus, key=lambda g: pcie_rate(g.pcie_gen, g.pcie_width))
    return LinkRate(min(rates), f"PCIe gen{slowest.pcie_gen} x{slowest.pcie_width}")


def inter_node_rate(backend: str, gpus_per_node: int, root: Path = INFINIBAND) -> LinkRate:
    """The network between nodes: the node's InfiniBand/RoCE ports' rates shared by its GPUs."""
    if backend == "gloo":
        return LinkRate(None, GLOO)
    ports = sorted(root.glob("*/ports/*/rate")) if root.is_dir() else []
    gbits = []
    for port in ports:
        match = re.match(r"\s*([\d.]+)\s*Gb/sec", port.read_text())
        state = port.parent / "state"
        if match and (not state.exists() or "ACTIVE" in state.read_text()):
            gbits.append(float(match.group(1)))
    if not gbits:
        return LinkRate(None, "no nominal rate: no active InfiniBand/RoCE port under /sys/class/infiniband")
    return LinkRate(sum(gbits) / 8 / gpus_per_node, f"{len(gbits)} port(s) of {max(gbits):g} Gb/s per node")
