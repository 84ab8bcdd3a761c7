"""What the doctor found, as text for the console and as the rates file `trainer plan` reads."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.doctor.busbw import OPS
from trainer.doctor.groups import INTER, INTRA
from trainer.doctor.measure import Measurement
from trainer.doctor.nominal import LinkRate
from trainer.doctor.sharded_overhead import FIELDS, Overhead
from trainer.doctor.topology import NodeTopology

SHARDED_NAMES = {"tp": "tensor parallel", "fsdp": "FSDP"}

WARN_FRACTION = 0.70  # nccl-tests' rule of thumb: a healthy link reaches 70% or more of its rate
FORMULAS = {"all_reduce": "algbw x 2(n-1)/n"} | {op: "algbw x (n-1)/n" for op in OPS[1:]}
HEADER = ("group", "ranks", "bytes", "time_ms", "algbw_GB/s", "busbw_GB/s", "of_nominal")


@dataclasses.dataclass(frozen=True)
class NodeReport:
    """One node's GPU side: its topology (None on the CPU or without NVML, with the reason) and its
    environment variables with their hints."""

    host: str
    topology: NodeTopology | None
    why_no_topology: str | None
    env: list[tuple[str, str | None, str | None]]


@dataclasses.dataclass(frozen=True)
class Findings:
    """Everything one run of the doctor measured and read."""

    backend: str
    device: str
    world_size: int
    gpus_per_node: int
    warmup: int
    iters: int
    matmul_tflops: float
    matmul_what: str
    measurements: list[Measurement]
    nominal: dict[str, LinkRate]  # group name -> the rate of the link it spans
    nodes: list[NodeReport]
    matmul_by_size: dict[int, float] = dataclasses.field(default_factory=dict)  # n -> rank 0's TFLOP/s alone
    matmul_together_tflops: float | None = None  # per rank, node 0's ranks all multiplying at once
    host_cores: int | None = None  # the CPU cores a rank may run on (CPU runs: ranks share them)
    # the host time of tensor parallelism and FSDP in pairs of ranks (sharded_overhead.py), by kind
    sharded: dict[str, Overhead] = dataclasses.field(default_factory=dict)
    sharded_rounds: int = 0  # the rounds each of its fields is the median of

    def best(self, op: str, group: str) -> float | None:
        """The highest busbw of `op` over `group` across sizes."""
        rates = [m.busbw for m in self.measurements if m.op == op and m.group == group]
        return max(rates) if rates else None


def text_report(f: Findings) -> str:
    """The console report: a table per collective, warnings, the matmul rate, the GPU side."""
    lines = [
        f"trainer doctor: {f.world_size} processes ({f.backend} on {f.device}), {f.gpus_per_node} per node; "
        f"time per call = the slowest rank's mean over {f.iters} calls after {f.warmup} warm-up calls; "
        "GB = 1e9 bytes",
        f"matmul (rank 0): {f.matmul_tflops:.4g} TFLOP/s ({f.matmul_what})",
    ]
    if f.matmul_by_size:
        lines.append(
            "matmul by size (rank 0 alone): "
            + ", ".join(f"{n}: {rate:.4g}" for n, rate in sorted(f.matmul_by_size.items()))
            + " TFLOP/s"
        )
    if f.matmul_together_tflops is not None:
        cores = f", {f.host_cores} cores" if f.host_cores is not None else ""
        lines.append(
            f"matmul with every rank of a node at once: {f.matmul_together_tflops:.4g} TFLOP/s per rank, "
            f"{f.matmul_together_tflops / f.matmul_tflops:.2f} x one rank alone ({f.gpus_per_node} ranks{cores})"
        )
    for kind, o in f.sharded.items():
        lines.append(
            f"{SHARDED_NAMES[kind]} (pairs of ranks), host time beyond compute and wire: "
            f"{o.block_s * 1e3:.3g} ms per block pass, {o.pass_s * 1e3:.3g} ms per model pass (forward + backward); "
            f"optimizer step and clip: {o.step_block_s * 1e3:.3g} ms per block, {o.step_s * 1e3:.3g} ms more "
            f"(medians of {f.sharded_rounds} rounds)"
        )
    for op in OPS:
        rows = [m for m in f.measurements if m.op == op]
        lines += ["", f"{op}: busbw = {FORMULAS[op]} (nccl-tests)", _row(HEADER)]
        for m in rows:
            rate = f.nominal[m.group].gbps
            share = "-" if rate is None else f"{100 * m.busbw / rate:.0f}%"
            lines.append(
                _row(
                    (
                        m.group,
                        m.ranks,
                        m.nbytes,
                        f"{1e3 * m.seconds:.4g}",
                        f"{m.algbw:.4g}",
                        f"{m.busbw:.4g}",
                        share,
                    )
                )
            )
    lines += ["", "nominal rates:"]
    lines += [f"  {group}: {_rate_text(rate)}" for group, rate in f.nominal.items()]
    lines += warnings(f)
    lines += _gpu_lines(f)
    return "\n".join(lines)


def warnings(f: Findings) -> list[str]:
    """A line for each op and group whose best busbw is below WARN_FRACTION of its link's nominal rate."""
    found = []
    for op in OPS:
        for group, rate in f.nominal.items():
            best = f.best(op, group)
            if rate.gbps is not None and best is not None and best < WARN_FRACTION * rate.gbps:
                found.append(
                    f"warning: {group} {op} reaches {best:.3g} GB/s busbw, {100 * best / rate.gbps:.0f}% of the "
                    f"nominal {rate.gbps:g} GB/s ({rate.what}); below {100 * WARN_FRACTION:.0f}% the link or its "
                    "set-up is suspect (see the NCCL variables below)"
                )
    return found


def _row(cells: tuple[Any, ...]) -> str:
    group, *rest = map(str, cells)
    return f"  {group:<14}" + "".join(f"{cell:>12}" for cell in rest)


def _rate_text(rate: LinkRate) -> str:
    return rate.what if rate.gbps is None else f"{rate.gbps:g} GB/s per direction ({rate.what})"


def _gpu_lines(f: Findings) -> list[str]:
    if f.device != "cuda":
        return [
            "",
            f"GPU checks (NVML topology, ECC/XID, NCCL variables): none, this run is {f.backend} on the CPU",
        ]
    lines = []
    for node in f.nodes:
        lines += ["", f"node {node.host}:"]
        if node.topology is None:
            lines.append(f"  topology: unknown ({node.why_no_topology})")
        else:
            lines += _topology_lines(node.topology)
        lines.append("  environment:")
        for name, value, hint in node.env:
            shown = "(unset)" if value is None else repr(value)
            lines.append(f"    {name}={shown}" + (f"  <- {hint}" if hint else ""))
    return lines


def _topology_lines(topology: NodeTopology) -> list[str]:
    gpus = topology.gpus
    lines = ["  GPU  name / PCIe / NVLinks, then the link to each other GPU (as nvidia-smi topo -m)"]
    for gpu in gpus:
        links = " ".join(
            "X" if other.index == gpu.index else topology.links[tuple(sorted((gpu.index, other.index)))]
            for other in gpus
        )
        pcie = f"gen{gpu.pcie_gen} x{gpu.pcie_width}" if gpu.pcie_gen else "PCIe ?"
        lines.append(f"  {gpu.index:<4} {gpu.name} / {pcie} / {gpu.nvlinks} NVLinks:  {links}")
    problems = topology.problems()
    lines += [f"  error: {p}" for p in problems] or ["  errors: none (uncorrected ECC, remapped rows, XIDs)"]
    return lines


def rates_file(f: Findings) -> dict[str, Any]:
    """The rates file (`--out`): link rates per kind, the matmul rate and every busbw, GB/s."""
    several_nodes = f.gpus_per_node < f.world_size
    intra, inter = (INTRA, INTER) if several_nodes else ("world", "world")
    data: dict[str, Any] = {
        "backend": f.backend,
        "device": f.device,
        "world_size": f.world_size,
        "gpus_per_node": f.gpus_per_node,
        "matmul_tflops": f.matmul_tflops,
        "links": {
            kind: {
                "busbw_GBps": f.best("all_reduce", group),
                "nominal_GBps": f.nominal[group].gbps if group in f.nominal else None,
            }
            for kind, group in (("intra_node", intra), ("inter_node", inter))
        },  # intra_node is null with one GPU per node: no group of one node to measure
        "collectives": {op: _by_group([m for m in f.measurements if m.op == op]) for op in OPS},
        "group_ranks": {m.group: m.ranks for m in f.measurements},
        "matmul_tflops_by_size": {str(n): rate for n, rate in sorted(f.matmul_by_size.items())},
        "matmul_together_tflops": f.matmul_together_tflops,
        "host_cores": f.host_cores,
        **{f"{kind}_{name}": getattr(o, name) for kind, o in f.sharded.items() for name in FIELDS},
    }
    if not several_nodes:
        data["note"] = (
            "one node: inter_node is the intra-node measurement (no link between nodes was measured)"
        )
    return data


def _by_group(measurements: list[Measurement]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for m in measurements:
        table.setdefault(m.group, {})[str(m.nbytes)] = m.busbw
    return table
