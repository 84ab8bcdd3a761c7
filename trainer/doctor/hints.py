"""The NCCL (and CUDA) environment variables in effect on a node, each with a one-line hint when its value
looks wrong for the node it is on. The rules read only the values and the node's facts, so they are tested
on given numbers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

VARIABLES = (
    "NCCL_IB_HCA",
    "NCCL_SOCKET_IFNAME",
    "NCCL_P2P_DISABLE",
    "NCCL_NET_GDR_LEVEL",
    "CUDA_VISIBLE_DEVICES",
)
GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")  # NCCL's names; 0..4 are the same levels as numbers
TRUE = ("1", "true", "yes", "y", "on")


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    """What the hints compare the variables with."""

    nvlink: bool  # every pair of this node's GPUs is on NVLink
    gpus: int | None  # GPUs on the node (NVML's count), None if unknown
    local_ranks: int
    nodes: int
    hcas: tuple[str, ...]  # InfiniBand/RoCE devices (/sys/class/infiniband)
    interfaces: tuple[str, ...]  # network interfaces (/sys/class/net)


def node_facts(nvlink: bool, gpus: int | None, local_ranks: int, nodes: int) -> NodeFacts:
    """NodeFacts with this machine's HCAs and network interfaces."""

    def names(folder: str) -> tuple[str, ...]:
        path = Path(folder)
        return tuple(sorted(p.name for p in path.iterdir())) if path.is_dir() else ()

    return NodeFacts(
        nvlink, gpus, local_ranks, nodes, names("/sys/class/infiniband"), names("/sys/class/net")
    )


def env_hints(env: Mapping[str, str], facts: NodeFacts) -> list[tuple[str, str | None, str | None]]:
    """(variable, its value or None if unset, a hint or None) for each of VARIABLES."""
    rules = {
        "NCCL_IB_HCA": _ib_hca,
        "NCCL_SOCKET_IFNAME": _socket_ifname,
        "NCCL_P2P_DISABLE": _p2p_disable,
        "NCCL_NET_GDR_LEVEL": _gdr_level,
        "CUDA_VISIBLE_DEVICES": _visible_devices,
    }
    return [
        (name, env.get(name), None if name not in env else rules[name](env[name], facts))
        for name in VARIABLES
    ]


def _selection(value: str, available: tuple[str, ...]) -> tuple[bool, list[str], list[str]]:
    """NCCL's list syntax ('^' excludes, '=' matches exactly, else by prefix; ':port' ignored): whether it
    excludes, the entries that match nothing, and the available names it selects."""
    exclude = value.startswith("^")
    value = value.lstrip("^")
    exact = value.startswith("=")
    entries = [e.split(":")[0].strip() for e in value.lstrip("=").split(",") if e.strip()]

    def matches(entry: str, name: str) -> bool:
        return name == entry if exact else name.startswith(entry)

    unknown = [e for e in entries if not any(matches(e, n) for n in available)]
    hit = [n for n in available if any(matches(e, n) for e in entries)]
    selected = [n for n in available if n not in hit] if exclude else hit
    return exclude, unknown, selected


def _ib_hca(value: str, facts: NodeFacts) -> str | None:
    if not facts.hcas:
        return (
            "this node has no InfiniBand/RoCE device (/sys/class/infiniband is empty): NCCL uses TCP sockets"
        )
    exclude, unknown, selected = _selection(value, facts.hcas)
    if unknown and not exclude:
        return f"names {', '.join(unknown)}, which this node does not have (it has {', '.join(facts.hcas)})"
    if not selected:
        return f"selects none of this node's HCAs ({', '.join(facts.hcas)}): NCCL falls back to TCP sockets"
    return None


def _socket_ifname(value: str, facts: NodeFacts) -> str | None:
    exclude, unknown, selected = _selection(value, facts.interfaces)
    if facts.nodes > 1 and selected and all(name == "lo" for name in selected):
        return "the loopback interface cannot reach other nodes: name the interface between the nodes"
    if unknown and not exclude and not selected:
        return f"matches no interface of this node (it has {', '.join(facts.interfaces) or 'none'})"
    return None


def _p2p_disable(value: str, facts: NodeFacts) -> str | None:
    if value.strip().lower() in TRUE and facts.nvlink:
        return "turns off NVLink peer-to-peer on an NVLink node: GPU-to-GPU traffic goes through host memory; unset it"
    return None


def _gdr_level(value: str, facts: NodeFacts) -> str | None:
    level = value.strip().upper()
    if level not in GDR_LEVELS and not (level.isdigit() and int(level) < len(GDR_LEVELS)):
        return f"is no GPUDirect RDMA level; allowed: {', '.join(GDR_LEVELS)} (or 0-{len(GDR_LEVELS) - 1})"
    if level in ("LOC", "0") and facts.nodes > 1 and facts.hcas:
        return "turns GPUDirect RDMA off: traffic between nodes is copied through host memory; unset it"
    return None


def _visible_devices(value: str, facts: NodeFacts) -> str | None:
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if not entries:
        return "hides every GPU from this process"
    if len(set(entries)) < len(entries):
        return "lists a GPU twice: two ranks would share it"
    if facts.gpus is not None:
        absent = [e for e in entries if e.isdigit() and int(e) >= facts.gpus]
        if absent:
            return f"names GPU {', '.join(absent)} but this node has {facts.gpus} (0-{facts.gpus - 1})"
    if len(entries) < facts.local_ranks:
        return (
            f"shows {len(entries)} GPU(s) to {facts.local_ranks} ranks on this node: ranks would share a GPU"
        )
    return None
