"""What the planner assumes of the machines: a small table of devices and links (datasheet numbers, with
their sources), or the rates `trainer doctor` measured on the real world (a rates file). The step-time
model reads one `Hardware`: a device's achievable matmul rate, the links a group can span, and, when
measured, the bus bandwidth of each collective by message size.

Bandwidths are bus bandwidths in nccl-tests' sense (GB/s, GB = 1e9 bytes): the rate at which each rank
moves its share, so a collective of S bytes over n ranks takes alpha + S * factor / busbw (Hockney's
latency-bandwidth model), factor 2(n-1)/n for an all-reduce and (n-1)/n for an all-gather, reduce-scatter
or all-to-all, and alpha a fixed cost per step of the ring (2(n-1) steps for an all-reduce, n-1 for the
others): what a small message pays whatever its size.

Compute runs at the device's matmul rate, which a measured machine refines by the size of each matmul (the
doctor times n x n products at a few n) and by what ranks sharing one host cost each other (the doctor
times the matmul on every rank at once against one rank alone: CPU processes share cores, caches and
memory bandwidth; GPUs share nothing). On a CPU host with no core to spare, a collective runs on the cores
that compute, so it hides behind nothing.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

GB = 1e9
# The GEMM efficiency curve, one for every GPU (Device.gemm_rate): cuBLAS bf16 on a B200 (pyptx.dev/performance,
# its cuBLAS column: 1006, 1532 and 1610 TFLOP/s at 2048^3, 4096^3 and 8192^3 of a 2250 peak, i.e. 45%, 68%,
# 72%) fits gemm_max 0.76 with the half-way point at 2 ridges (B200's ridge is n ~ 840: 1700 gives 45/65/73%).
# The same saturation is what NVIDIA's "Matrix Multiplication Background" guide shows on A100 and H100: large
# products at 70-80% of the tensor-core peak, small ones bound by wave and tile quantization and by HBM.
GEMM_MAX = 0.76
GEMM_HALF_RIDGES = 2.0
# The share of a kernel benchmark's tensor-core rate a training step sustains: benchmarks time bursts of tens
# of milliseconds at boost clock on square, cache-friendly operands; hours of dense matmuls run into the
# board's power limit (A100 400 W, H100 700 W) and clock down, the backward's transposed operands and the
# launch gaps between kernels cost more. One number for every device and model, the only one fitted: on the
# tuning points of bench/plan_vs_published.py (median error 20% at 1.0, 6% at 0.85, 4% at 0.8), with the
# held-out third as its check (5% at 0.8). Re-scanned with TorchTitan's 500 W device and the published
# checkpointing and ZeRO-3 units: 4.7% at 0.76, 4.0% at 0.78, 3.7% at 0.8, 5.4% at 0.82 (held out: 4.0%).
SUSTAINED_SHARE = 0.8


@dataclass(frozen=True)
class Device:
    """One accelerator: its dense bf16 peak (no sparsity), its memory and, for a GPU, what its kernels reach:
    HBM bandwidth (the roofline of memory-bound work), the share of the peak its largest GEMMs reach, and
    flash attention's share. A device without `hbm_GBps` (a CPU process) runs every matmul at `achievable`."""

    name: str
    bf16_tflops: float
    memory_bytes: float
    # the share of the peak a step's matmuls reach where nothing finer is known (no HBM bandwidth given)
    achievable: float = 0.5
    fp32_ratio: float = 0.5  # fp32 matmuls run as TF32 at half the bf16 rate (the same datasheets)
    hbm_GBps: float | None = None
    gemm_max: float = GEMM_MAX
    attention_efficiency: float = 0.35
    # the tensor-core clock its board's power limit sustains, as a share of the clock `bf16_tflops` is rated
    # at (`power_limited_share`); 1 for a device run at the power its datasheet rates it at
    clock_share: float = 1.0

    @property
    def sustained_flops(self) -> float:
        """FLOP/s a training step's tensor cores sustain at best: the peak at the clock its power limit
        allows, times the share of a kernel benchmark's rate a training step sustains (SUSTAINED_SHARE)."""
        return self.bf16_tflops * 1e12 * self.clock_share * SUSTAINED_SHARE

    @property
    def ridge(self) -> float:
        """The n of the n x n x n bf16 product whose intensity (n/3 FLOP per byte) meets the roofline's ridge
        (peak at its clock over HBM bandwidth): smaller products are memory-bound."""
        peak = self.bf16_tflops * 1e12 * self.clock_share
        return 3 * peak / (self.hbm_GBps * GB) if self.hbm_GBps else 0.0

    def gemm_rate(self, n: float, fill: float | None = None) -> float:
        """FLOP/s of a bf16 GEMM as arithmetic-intense as an n x n x n one: the roofline (peak, or HBM
        bandwidth times its n/3 FLOP per byte, whichever is lower) times the GEMM efficiency curve
        gemm_max * f^2 / (f^2 + (2 ridge)^2), f the cube root of the work that fills the GPU (`fill`: a
        batched GEMM's whole batch; n for one product): small products leave SMs idle (waves and tiles not
        filled) and their loads unhidden; large ones saturate at gemm_max."""
        if not self.hbm_GBps:
            return self.bf16_tflops * 1e12 * self.achievable
        peak = self.sustained_flops
        half = GEMM_HALF_RIDGES * self.ridge
        f = n if fill is None else fill
        roof = min(peak, self.hbm_GBps * GB * n / 3)
        return roof * self.gemm_max * f * f / (f * f + half * half)


@dataclass(frozen=True)
class Link:
    """A link a group of ranks can span, per GPU and direction: its nominal rate and the all-reduce bus
    bandwidth nccl-tests reaches on it."""

    name: str
    nominal_GBps: float
    busbw_GBps: float
    latency_us: float = 0.0  # fixed cost of one step of a ring over this link (NCCL's LL protocol)


def ring_steps(op: str, n: int) -> int:
    """Sequential steps of a ring collective over `n` ranks: 2(n-1) for an all-reduce (a reduce-scatter then
    an all-gather), n-1 for the others; each pays the link's latency once."""
    return (2 if op == "all_reduce" else 1) * max(n - 1, 0)


def bus_factor(op: str, n: int) -> float:
    """The share of a message of S bytes each rank moves: 2(n-1)/n for an all-reduce, (n-1)/n otherwise."""
    return (2 if op == "all_reduce" else 1) * (n - 1) / n


def power_limited_share(limit_w: float, rated_w: float) -> float:
    """The tensor-core clock a board held to `limit_w` sustains, as a share of the clock it reaches at the
    `rated_w` its datasheet rates its peak at: dense matmuls run a GPU at its power limit, and dynamic power
    goes as f V^2 with the voltage rising with the clock, so about as f^3: the clock as the cube root of the
    power. Checked on the datasheets of one die: the H100 NVL (the SXM part's 132 SMs, 350-400 W) is rated
    at 835 TFLOP/s bf16 dense (1,671 with sparsity), the rule from the SXM's 989 at 700 W gives 821 at 400 W."""
    return (limit_w / rated_w) ** (1 / 3)


# Sources: NVIDIA's datasheets (H100: "H100 Tensor Core GPU" datasheet, SXM column, 989 TFLOP/s bf16
# dense (1979 with sparsity), 3.35 TB/s HBM3; H200: "H200 Tensor Core GPU" datasheet, same compute, 141 GB
# HBM3e at 4.8 TB/s; B200: "HGX B200" datasheet, 2.25 PFLOP/s bf16 dense per GPU, 180 GB HBM3e at 8 TB/s; A100:
# "A100 Tensor Core GPU" datasheet, 312 TFLOP/s bf16 dense, 80 GB HBM2e at 2.039 TB/s).
# Flash attention's share of the peak, forward and backward together: FlashAttention-2 (Dao 2023) reaches
# 50-73% of A100's peak in the forward and less in the backward (~50% of the two); on H100 it reaches ~35%
# (Shah et al. 2024, FlashAttention-3, their FA2 baseline: ~350 of 989 TFLOP/s), which PyTorch's SDPA runs.
DEVICES: dict[str, Device] = {
    "h100": Device("H100 SXM 80GB", 989.0, 80e9, hbm_GBps=3350.0),
    "h200": Device("H200 SXM 141GB", 989.0, 141e9, hbm_GBps=4800.0),
    "b200": Device("B200 180GB", 2250.0, 180e9, hbm_GBps=8000.0),
    "a100": Device("A100 SXM 80GB", 312.0, 80e9, hbm_GBps=2039.0, attention_efficiency=0.5),
    # the H100 of Meta's Grand Teton hosts that TorchTitan benchmarked on (github.com/pytorch/torchtitan,
    # benchmarks/llama3_h100_202412_torchtitan.md, "Hardware"): SXM, 96 GB of HBM2e at 2.4 TB/s, run at its
    # default 500 W power limit; its MFU is over the SXM's 989 TFLOP/s (that page's footnote 2: "the actual
    # peak ... is between SXM and NVL"), its clock the 500 W one (power_limited_share: 0.894, 884 TFLOP/s).
    # Its memory: 6 HBM2e stacks of 16 GiB, of which an HBM2e H100 at 2.41 TB/s shows 94 GiB (Ujeniya et al.
    # 2026, "A Comparative Study of power-capping NVIDIA H100 and H200", arXiv 2604.11391, their testbed)
    "h100-hbm2e-500w": Device(
        "H100 SXM 96GB HBM2e at 500 W",
        989.0,
        94 * 2**30,
        hbm_GBps=2400.0,
        clock_share=power_limited_share(500.0, 700.0),
    ),
}

# Sources: NVLink 3/4/5 at 600/900/1800 GB/s per GPU both directions together (NVIDIA's A100/H100/B200
# datasheets), i.e. 300/450/900 per direction; nccl-tests all_reduce_perf on a DGX H100 reaches ~360 GB/s
# busbw (80% of 450; NVIDIA's NCCL performance notes), the same share is assumed on NVLink 3 and 5. PCIe
# Gen5 x16: 64 GB/s per direction (PCI-SIG), ~80% reached. InfiniBand NDR 400 Gb/s = 50 GB/s per port and
# direction, one port per GPU (rail-optimised DGX SuperPOD, NVIDIA's reference architecture), ~90%
# reached by NCCL across nodes; HDR 200 Gb/s = 25 GB/s per port (DGX A100: 8 HDR NICs per node); RoCE at 400 GbE the same port rate, ~80% reached (congestion control).
# Latency per ring step: nccl-tests' small-message all_reduce_perf on one 8-GPU NVLink node takes ~10-15 us
# (14 steps: ~1 us each); a hop between nodes costs the NIC, the switch and NCCL's proxy thread, ~5 us on
# IB (1-2 us of wire and switch) and somewhat more on RoCE; a PCIe hop through the host ~2 us.
LINKS: dict[str, Link] = {
    "nvlink3": Link("NVLink 3 (A100)", 300.0, 240.0, 1.0),
    "nvlink4": Link("NVLink 4 (H100/H200)", 450.0, 360.0, 1.0),
    "nvlink5": Link("NVLink 5 (B200)", 900.0, 720.0, 1.0),
    "pcie5": Link("PCIe Gen5 x16", 64.0, 51.0, 2.0),
    "ib-ndr": Link("InfiniBand NDR 400G, one NIC per GPU", 50.0, 45.0, 5.0),
    "ib-hdr": Link("InfiniBand HDR 200G, one NIC per GPU", 25.0, 22.5, 5.0),
    "roce": Link("RoCE 400GbE, one NIC per GPU", 50.0, 40.0, 7.0),
}
NVLINK_OF = {
    "h100": "nvlink4",
    "h100-hbm2e-500w": "nvlink4",
    "h200": "nvlink4",
    "b200": "nvlink5",
    "a100": "nvlink3",
}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# the doctor's sharding overheads: the rates file's keys are "<kind>_<field>" (tp_block_s, fsdp_step_s, ...)
SHARDED_KINDS = ("tp", "fsdp")
SHARDED_FIELDS = ("block_s", "pass_s", "step_block_s", "step_s")


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
    group_ranks: dict[str, int] = field(default_factory=dict)  # ranks in each measured group
    matmul_by_size: dict[int, float] = field(default_factory=dict)  # n -> TFLOP/s of one rank alone
    matmul_together_tflops: float | None = None  # per rank with every rank of a node multiplying at once
    host_cores: int | None = None  # CPU cores a rank may run on; None on GPUs
    # the host time sharding adds (trainer/doctor/sharded_overhead.py): sharding ("tp", "fsdp") -> its
    # seconds per block pass, per model pass (forward and backward), per optimizer step per block and fixed
    # (AdamW and the clip on DTensor parameters), keyed by SHARDED_FIELDS; a missing one: not measured (0)
    sharded: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Refuse, by its key, a rate that is not a positive number: the step-time model divides by each."""
        rates = {
            "matmul_tflops": self.matmul_tflops,
            "links.intra_node.busbw_GBps": self.intra_busbw_GBps,
            "links.inter_node.busbw_GBps": self.inter_busbw_GBps,
            "matmul_together_tflops": self.matmul_together_tflops,
            **{f"matmul_tflops_by_size.{n}": rate for n, rate in self.matmul_by_size.items()},
            **{
                f"collectives.{op}.{group}.{size}": bw
                for op, groups in self.collectives.items()
                for group, sizes in groups.items()
                for size, bw in sizes.items()
            },
        }
        bad = next((key for key, rate in rates.items() if rate is not None and not rate > 0), None)
        if bad is not None:
            raise ValueError(f"{bad} is {rates[bad]}, not a positive rate")

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
                group_ranks={str(g): int(n) for g, n in (data.get("group_ranks") or {}).items()},
                matmul_by_size={
                    int(n): float(r) for n, r in (data.get("matmul_tflops_by_size") or {}).items()
                },
                matmul_together_tflops=_optional_float(data.get("matmul_together_tflops")),
                host_cores=None if data.get("host_cores") is None else int(data["host_cores"]),
                sharded={
                    kind: {
                        f: _named_float(data, f"{kind}_{f}")
                        for f in SHARDED_FIELDS
                        if data.get(f"{kind}_{f}") is not None
                    }
                    for kind in SHARDED_KINDS
                },
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(
                f"{where}: {type(err).__name__} {err}; allowed: the JSON `trainer doctor --out` writes "
                "(backend, device, world_size, gpus_per_node, matmul_tflops, links, collectives)"
            ) from None

    def _table(self, op: str, group: str) -> tuple[str, dict[int, float]] | None:
        groups = self.collectives.get(op, {})
        name = group if groups.get(group) else "world"
        return (name, groups[name]) if groups.get(name) else None

    def busbw(self, op: str, group: str, nbytes: float) -> float | None:
        """The measured busbw (GB/s) of `op` over `group` (else over the world) for a message of `nbytes`,
        interpolated in log(size) between measured sizes and held flat outside them; None if not measured."""
        found = self._table(op, group)
        return None if found is None else _log_interpolate(found[1], nbytes)

    def latency_bandwidth(self, op: str, group: str) -> tuple[float, dict[int, float]] | None:
        """`op` over `group` (else the world) split as Hockney's model: the fixed cost of one ring step
        (seconds) and, per measured size, the busbw (GB/s) of what is left of its time. The fixed cost is
        where the line through the two smallest sizes' times meets size 0 (0 when the larger was the
        faster); None if not measured."""
        found = self._table(op, group)
        if found is None:
            return None
        name, table = found
        n = self.group_ranks.get(name) or self.world_size
        factor = bus_factor(op, n)
        times = {size: size * factor / (bw * GB) for size, bw in table.items()}
        sizes = sorted(times)
        alpha = 0.0
        if len(sizes) > 1:
            s0, s1 = sizes[:2]
            slope = (times[s1] - times[s0]) / (s1 - s0)
            if slope > 0:  # else noise: a bigger message was faster, no fixed cost can be told apart
                alpha = max(times[s0] - slope * s0, 0.0)
        rest = {size: size * factor / (times[size] - alpha) / GB for size in sizes}
        return alpha / max(ring_steps(op, n), 1), rest


def _named_float(data: dict[str, Any], key: str) -> float:
    """data[key] as a float; a ValueError naming the key when it is not a number."""
    try:
        return float(data[key])
    except (TypeError, ValueError):
        raise ValueError(f"{key} is {data[key]!r}, not a number") from None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _log_interpolate(table: dict[int, float], x: float) -> float:
    """table's value at x, linear in log(x) between its keys and held flat outside them."""
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    if x >= keys[-1]:
        return table[keys[-1]]
    i = bisect.bisect_left(keys, x)
    lo, hi = keys[i - 1], keys[i]
    t = (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
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

    @property
    def peak_flops_per_s(self) -> float:
        """MFU's denominator (FLOP/s): the fastest matmul rate measured at any size, as `matmul_rate`
        scales it (a CPU has no datasheet peak; its small products can outrun its largest), else the
        device's datasheet bf16 peak."""
        if self.rates is None:
            return self.device.bf16_tflops * 1e12
        sizes = self.rates.matmul_by_size
        return self.flops_per_s * (max(sizes.values()) / sizes[max(sizes)] if sizes else 1.0)

    def busbw(self, op: str, group: str, nbytes: float, inter_node: bool) -> float:
        """Bus bandwidth (bytes/s) of `op` over the ranks of `group`, whose ring crosses nodes or not."""
        measured = self.rates.busbw(op, group, nbytes) if self.rates is not None else None
        if measured is not None:
            return measured * GB
        return (self.inter if inter_node else self.intra).busbw_GBps * GB

    def collective_s(self, op: str, group: str, nbytes: float, n: int, inter_node: bool) -> float:
        """Seconds of one `op` of `nbytes` (the full buffer) over `n` ranks of `group`: the ring's steps
        times a step's fixed cost, plus the bytes each rank moves over the bus bandwidth. Measured rates
        give both per op and group (`Rates.latency_bandwidth`), else the link's table values."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        fit = self.rates.latency_bandwidth(op, group) if self.rates is not None else None
        if fit is not None:
            step_s, busbw = fit[0], _log_interpolate(fit[1], nbytes) * GB
        else:
            link = self.inter if inter_node else self.intra
            step_s, busbw = link.latency_us * 1e-6, link.busbw_GBps * GB
        return ring_steps(op, n) * step_s + nbytes * bus_factor(op, n) / busbw

    def matmul_rate(self, n: float) -> float:
        """FLOP/s of a matmul whose arithmetic intensity is an n x n product's: measured at a few sizes
        (interpolated in log n, flat outside), scaled to the rate `flops_per_s` gives (flat when only one rate
        was measured); unmeasured, the device's roofline and GEMM efficiency curve (`Device.gemm_rate`)."""
        if self.rates is None:
            return self.device.gemm_rate(n)
        sizes = self.rates.matmul_by_size
        if not sizes:
            return self.flops_per_s
        return self.flops_per_s * _log_interpolate(sizes, n) / sizes[max(sizes)]

    def sharing(self, ranks_on_host: int) -> float:
        """Each rank's share of its matmul rate when `ranks_on_host` ranks of a host compute at once: the
        doctor's all-ranks-at-once rate over one rank's alone, at its ranks per node (linear in between
        from 1 alone); 1 when not measured (GPUs: a rank has its device to itself)."""
        r = self.rates
        if r is None or r.matmul_together_tflops is None or ranks_on_host <= 1 or r.gpus_per_node <= 1:
            return 1.0
        alone = (
            r.matmul_by_size.get(max(r.matmul_by_size), r.matmul_tflops)
            if r.matmul_by_size
            else r.matmul_tflops
        )
        measured = min(r.matmul_together_tflops / alone, 1.0)
        t = min((ranks_on_host - 1) / (r.gpus_per_node - 1), 1.0)
        return 1.0 - t * (1.0 - measured)

    def overlap(self, ranks_on_host: int) -> float:
        """The share of a collective that can run behind compute: all of it on a GPU (its copy engines and
        NCCL's kernels run beside the compute), on a CPU host only as much as its spare cores carry (gloo
        moves and reduces the bytes on CPU threads)."""
        cores = self.rates.host_cores if self.rates is not None else None
        if cores is None:
            return 1.0
        return min(max((cores - ranks_on_host) / max(ranks_on_host, 1), 0.0), 1.0)


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
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"memory size {text!r} is invalid; allowed: a positive finite size")
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
