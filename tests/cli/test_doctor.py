"""`trainer doctor`: busbw of the four collectives measured in a real gloo world of 4 processes (table and
rates file checked against nccl-tests' formulas, recomputed here), the GPU side on a fake NVML node (CI has
no GPU), the NCCL variable hints on given facts, and bad input refused before anything starts."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest
import torch
from helpers import failure, run_cli

from trainer import cli
from trainer.doctor.hints import NodeFacts, env_hints
from trainer.doctor.measure import Measurement
from trainer.doctor.nominal import LinkRate, intra_node_rate
from trainer.doctor.report import Findings, NodeReport, rates_file, text_report, warnings
from trainer.doctor.topology import PCIE_PATHS, NodeProbe, load_nvml

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
ROW = re.compile(r"^  (\S+)\s+(\d+)\s+(\d+)\s+([\d.e+-]+)\s+([\d.e+-]+)\s+([\d.e+-]+)\s+(\S+)$")


def factor(op: str, n: int) -> float:
    """nccl-tests' bus factor, written out: all-reduce moves 2(n-1)/n of the message, the others (n-1)/n."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def tables(text: str) -> dict[str, list[tuple]]:
    """The rows of each op's table: (group, ranks, bytes, time_ms, algbw, busbw, of_nominal)."""
    found: dict[str, list[tuple]] = {}
    op = None
    for line in text.splitlines():
        head = re.match(r"^(\w+): busbw = ", line)
        if head:
            op = head.group(1)
            found[op] = []
        elif op and (row := ROW.match(line)):
            g, n, b, t, alg, bus, share = row.groups()
            found[op].append((g, int(n), int(b), float(t), float(alg), float(bus), share))
    return found


@pytest.mark.slow
def test_doctor_on_four_gloo_processes_prints_busbw_per_group_and_size(tmp_path):
    out = tmp_path / "rates.json"
    sizes = (65536, 262144)
    result = run_cli(
        "doctor", "--devices", "4", "--gpus-per-node", "2", "--mesh", "dp_shard=2,tp=2",
        "--sizes", ",".join(map(str, sizes)), "--warmup", "1", "--iters", "2", "--rounds", "3", "--out", str(out),
        cwd=tmp_path, timeout=120, ranks=4,
    )  # fmt: skip
    assert result.returncode == 0, failure(result.stderr)
    found = tables(result.stdout)
    assert sorted(found) == sorted(OPS), result.stdout
    groups = {"world": 4, "intra_node": 2, "inter_node": 2, "dp_shard": 2, "tp": 2}
    rates = json.loads(out.read_text())
    for op, rows in found.items():
        assert {(g, n, b) for g, n, b, *_ in rows} == {(g, n, b) for g, n in groups.items() for b in sizes}, (
            op
        )
        for group, n, nbytes, time_ms, algbw, busbw, share in rows:
            where = f"{op} {group} {nbytes} B"
            assert time_ms > 0 and share == "-", where  # gloo: no nominal rate
            # 4 significant digits printed: the relations hold to that rounding
            assert algbw == pytest.approx(nbytes / (time_ms * 1e-3) / 1e9, rel=2e-3), where
            assert busbw == pytest.approx(algbw * factor(op, n), rel=2e-3), where
            assert rates["collectives"][op][group][str(nbytes)] == pytest.approx(busbw, rel=1e-3), where
    assert "no nominal rate" in result.stdout and "none, this run is gloo on the CPU" in result.stdout
    assert rates["backend"] == "gloo" and rates["device"] == "cpu" and rates["world_size"] == 4
    assert rates["gpus_per_node"] == 2 and rates["matmul_tflops"] > 0 and "note" not in rates
    # what the planner's step time reads besides busbw: each group's ranks, the matmul by size (the largest
    # is the one reported), every rank of a node multiplying at once, the cores the ranks share
    assert rates["group_ranks"] == groups
    by_size = {int(n): rate for n, rate in rates["matmul_tflops_by_size"].items()}
    assert sorted(by_size) == [64, 128, 256, 512, 1024] and all(rate > 0 for rate in by_size.values())
    assert by_size[1024] == rates["matmul_tflops"] and rates["matmul_together_tflops"] > 0
    assert rates["host_cores"] == len(os.sched_getaffinity(0))
    assert "matmul with every rank of a node at once" in result.stdout
    # DTensor's bookkeeping and FSDP's hooks cost milliseconds of host time per block pass on a CPU
    # (sharded_overhead.py), and per optimizer step: AdamW and the clip run each DTensor parameter's ops
    # through DTensor
    # (medians of the 3 rounds asked for: 7 by default, ~35 of the run's ~55 s here)
    assert result.stdout.count("(medians of 3 rounds)") == 2, result.stdout
    for kind in ("tp", "fsdp"):
        assert rates[f"{kind}_block_s"] + rates[f"{kind}_pass_s"] > 0, kind
        assert rates[f"{kind}_step_block_s"] + rates[f"{kind}_step_s"] > 0, kind
    for name in ("tensor parallel", "FSDP"):
        assert f"{name} (pairs of ranks), host time beyond compute and wire" in result.stdout
    assert result.stdout.count("optimizer step and clip:") == 2
    for kind in ("intra_node", "inter_node"):
        best = max(rates["collectives"]["all_reduce"][kind].values())
        assert rates["links"][kind] == {"busbw_GBps": best, "nominal_GBps": None}, kind
    assert "mesh dp_shard=2 x tp=2" in result.stderr  # the named groups are the strategy's own mesh


def findings(busbw: list[tuple[str, str, int, int, float]], nominal: dict[str, LinkRate], **kw) -> Findings:
    """Findings whose measurements have the given busbw (GB/s) at each (op, group, ranks, bytes)."""
    ms = [
        Measurement(op, group, n, nbytes, nbytes / (rate * 1e9 / factor(op, n)))
        for op, group, n, nbytes, rate in busbw
    ]
    base = dict(
        backend="nccl", device="cuda", world_size=8, gpus_per_node=8, warmup=5, iters=20, matmul_tflops=700.0,
        matmul_what="8192x8192 bfloat16", measurements=ms, nominal=nominal, nodes=[],
    )  # fmt: skip
    return Findings(**{**base, **kw})


def test_a_link_below_seventy_percent_of_nominal_is_warned_about():
    nvlink = LinkRate(450.0, "NVLink of NVIDIA H100 80GB HBM3")
    slow = findings(
        [("all_reduce", "world", 8, 1 << 30, 0.69 * 450), ("all_gather", "world", 8, 1 << 30, 0.71 * 450)],
        {"world": nvlink},
    )
    lines = warnings(slow)
    assert len(lines) == 1 and "world all_reduce" in lines[0] and "69%" in lines[0] and "450 GB/s" in lines[0]
    assert "69%" in text_report(slow) and "71%" in text_report(slow)  # the table's of_nominal column


def test_rates_file_on_one_node_says_inter_node_is_the_intra_node_rate():
    one = findings(
        [("all_reduce", "world", 8, 1 << 20, 300.0), ("all_reduce", "world", 8, 1 << 30, 310.0)],
        {"world": LinkRate(450.0, "x")},
    )
    data = rates_file(one)
    best = {"busbw_GBps": pytest.approx(310.0), "nominal_GBps": 450.0}  # the best size's
    assert data["links"]["inter_node"] == data["links"]["intra_node"] == best
    assert "one node" in data["note"]
    assert data["collectives"]["all_reduce"]["world"] == {
        str(1 << 20): pytest.approx(300.0),
        str(1 << 30): pytest.approx(310.0),
    }
    assert data["collectives"]["all_gather"] == {}


# ---- the GPU side, on a fake NVML ------------------------------------------------------------------
class FakeNode:
    """pynvml's names for a node of GPUs (handles are indices): `nvlinks[i]` maps each active link of GPU i
    to the bus id at its other end, `ancestor[(i, j)]` is their PCIe common ancestor level; unexposed
    readings answer "Not Supported" as on a real GPU that lacks them."""

    NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION = 2, 3, 4
    NVML_ERROR_TIMEOUT, NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_GPU_IS_LOST = 10, 13, 15
    NVML_NVLINK_MAX_LINKS = 36
    NVML_TEMPERATURE_GPU, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 0, 1, 0
    NVML_NVLINK_ERROR_DL_REPLAY, NVML_NVLINK_ERROR_DL_RECOVERY = 0, 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT, NVML_NVLINK_ERROR_DL_CRC_DATA = 2, 3
    nvmlEventTypeXidCriticalError = 0x8

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self, name, nvlinks, ancestor, ecc=None, xids=None) -> None:
        self.name, self.links, self.ancestor = name, nvlinks, ancestor
        self.ecc, self.xids = ecc or {}, {i: list(x) for i, x in (xids or {}).items()}
        self.sessions = 0

    def bus(self, i: int) -> str:
        return f"00000000:{0x18 + 0x10 * i:02X}:00.0"

    def _unsupported(self, *args):
        raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)

    nvmlDeviceGetPowerUsage = nvmlDeviceGetEnforcedPowerLimit = nvmlDeviceGetMemoryInfo = _unsupported
    nvmlDeviceGetTemperature = nvmlDeviceGetCurrentClocksEventReasons = nvmlDeviceGetPcieReplayCounter = (
        _unsupported
    )

    def nvmlInit(self):
        self.sessions += 1

    def nvmlShutdown(self):
        self.sessions -= 1

    def nvmlDeviceGetCount(self):
        return len(self.links)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, i):
        return self.name.encode()  # old pynvml answers bytes

    def nvmlDeviceGetPciInfo(self, i):
        return SimpleNamespace(busId=self.bus(i))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, i):
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, i):
        return 16

    def nvmlDeviceGetNvLinkState(self, i, link):
        if link not in self.links[i]:
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, i, link):
        return SimpleNamespace(busId=self.links[i][link])

    def nvmlDeviceGetNvLinkErrorCounter(self, i, link, counter):
        return 0

    def nvmlDeviceGetTopologyCommonAncestor(self, i, j):
        return self.ancestor[(min(i, j), max(i, j))]

    def nvmlDeviceGetTotalEccErrors(self, i, error_type, counter_type):
        return self.ecc.get(i, 0)

    def nvmlDeviceGetRemappedRows(self, i):
        return (0, 0, 0, 0)

    def nvmlEventSetCreate(self):
        return []

    def nvmlEventSetFree(self, events):
        pass

    def nvmlDeviceRegisterEvents(self, i, types, events):
        events.append(i)  # the set watches GPU i

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        pending = self.xids.get(events[0], [])
        if not pending:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT)
        return SimpleNamespace(eventType=self.nvmlEventTypeXidCriticalError, eventData=pending.pop(0))


def paired_pcie_node(**kw) -> FakeNode:
    """4 GPUs: 0-1 and 2-3 bridged by 2 NVLinks each, the rest over PCIe (0,2 / 1,3 under one CPU)."""
    node = FakeNode("NVIDIA H100 PCIe", [{}, {}, {}, {}], {}, **kw)
    for a, b in ((0, 1), (2, 3)):
        node.links[a] = {0: node.bus(b), 1: node.bus(b)}
        node.links[b] = {0: node.bus(a), 1: node.bus(a)}
    node.ancestor = {(0, 1): 20, (2, 3): 20, (0, 2): 40, (1, 3): 40, (0, 3): 50, (1, 2): 50}
    return node


def switch_node() -> FakeNode:
    """8 GPUs, each with 18 NVLinks to the NVSwitches (HGX H100)."""
    switch = "00000000:C0:00.0"
    return FakeNode("NVIDIA H100 80GB HBM3", [dict.fromkeys(range(18), switch) for _ in range(8)], {})


def test_nvml_topology_names_each_pair_and_the_gpus_in_error():
    node = paired_pcie_node(ecc={1: 3}, xids={2: [79], 3: [13]})  # XID 13 is the application's fault
    topology = NodeProbe(node, "gpu-a").read()
    assert node.sessions == 0  # every NVML session the probe opened is closed
    assert topology.links == {(0, 1): "NV2", (2, 3): "NV2", (0, 2): "NODE", (1, 3): "NODE", (0, 3): "SYS",
                              (1, 2): "SYS"}  # fmt: skip
    assert [g.nvlinks for g in topology.gpus] == [2, 2, 2, 2] and topology.gpus[0].name == "NVIDIA H100 PCIe"
    assert not topology.nvlink  # not every pair: the slowest path is PCIe
    problems = topology.problems()
    assert len(problems) == 2, problems
    assert "GPU 1" in problems[0] and "3 uncorrected ECC" in problems[0]
    assert "GPU 2" in problems[1] and "XID error(s) 79" in problems[1]
    rate = intra_node_rate(topology, "nccl")
    assert rate.gbps == pytest.approx(32 * 16 * 128 / 130 / 8) and rate.what == "PCIe gen5 x16"  # 63 GB/s


def test_nvswitch_node_gets_the_nvlink_rate_and_a_hint_against_p2p_disable():
    topology = NodeProbe(switch_node(), "gpu-b").read()
    assert set(topology.links.values()) == {"NVSwitch"} and len(topology.links) == 28 and topology.nvlink
    assert intra_node_rate(topology, "nccl") == LinkRate(450.0, "NVLink of NVIDIA H100 80GB HBM3")
    facts = NodeFacts(nvlink=True, gpus=8, local_ranks=8, nodes=1, hcas=(), interfaces=("eth0", "lo"))
    env = env_hints({"NCCL_P2P_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, facts)
    report = text_report(findings([], {"world": intra_node_rate(topology, "nccl")},
                                  nodes=[NodeReport("gpu-b", topology, None, env)]))  # fmt: skip
    assert "node gpu-b:" in report and "NVSwitch" in report and "errors: none" in report
    assert "NCCL_P2P_DISABLE='1'  <- turns off NVLink peer-to-peer" in report
    assert "CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6,7'\n" in report + "\n"  # a good value gets no hint
    assert "NCCL_IB_HCA=(unset)" in report


def test_the_fake_node_has_pynvml_names_and_values():
    pynvml = pytest.importorskip("pynvml")
    names = [n for n in vars(FakeNode) if n.startswith(("NVML_", "nvml"))]
    assert [n for n in names if not hasattr(pynvml, n)] == []
    constants = {n: getattr(FakeNode, n) for n in names if isinstance(getattr(FakeNode, n), int)}
    assert {n: v for n, v in constants.items() if getattr(pynvml, n) != v} == {}
    levels = ("INTERNAL", "SINGLE", "MULTIPLE", "HOSTBRIDGE", "NODE", "SYSTEM")
    assert sorted(PCIE_PATHS) == [getattr(pynvml, f"NVML_TOPOLOGY_{level}") for level in levels]


def test_the_real_nvml_reads_this_machine_or_fails_as_nvml_does():
    """The path the doctor takes on a GPU node, with the real pynvml: here (no NVIDIA driver) NVML refuses to
    start, which the doctor reports; on a GPU machine it reads every GPU."""
    pynvml, why = load_nvml()
    if pynvml is None:
        pytest.skip(why)
    try:
        probe = NodeProbe(pynvml, "here")
    except pynvml.NVMLError as err:
        assert not torch.cuda.is_available(), f"NVML failed on a machine with CUDA: {err}"
        return
    topology = probe.read()
    assert len(topology.gpus) >= torch.cuda.device_count() > 0
    assert len(topology.links) == len(topology.gpus) * (len(topology.gpus) - 1) // 2


# ---- the hints, on given facts ------------------------------------------------------------------------
IB_NODE = NodeFacts(
    nvlink=True, gpus=8, local_ranks=8, nodes=4, hcas=("mlx5_0", "mlx5_1"), interfaces=("ens1", "lo")
)
HINTS = {
    # name: (variable, value, facts, words in the hint; None: no hint)
    "p2p_off_on_nvlink": ("NCCL_P2P_DISABLE", "1", IB_NODE, "turns off NVLink"),
    "p2p_off_without_nvlink": ("NCCL_P2P_DISABLE", "1", NodeFacts(False, 2, 2, 1, (), ()), None),
    "p2p_on": ("NCCL_P2P_DISABLE", "0", IB_NODE, None),
    "hca_missing": ("NCCL_IB_HCA", "mlx5_0,mlx5_9", IB_NODE, "names mlx5_9"),
    "hca_prefix_matches": ("NCCL_IB_HCA", "mlx5", IB_NODE, None),
    "hca_exact_with_port": ("NCCL_IB_HCA", "=mlx5_0:1,mlx5_1:1", IB_NODE, None),
    "hca_exact_needs_the_whole_name": ("NCCL_IB_HCA", "=mlx5", IB_NODE, "names mlx5"),
    "hca_all_excluded": ("NCCL_IB_HCA", "^mlx5", IB_NODE, "selects none"),
    "hca_without_infiniband": (
        "NCCL_IB_HCA",
        "mlx5_0",
        NodeFacts(True, 8, 8, 2, (), ("eth0",)),
        "no InfiniBand",
    ),
    "ifname_loopback_across_nodes": ("NCCL_SOCKET_IFNAME", "lo", IB_NODE, "loopback"),
    "ifname_loopback_one_node": ("NCCL_SOCKET_IFNAME", "lo", NodeFacts(True, 8, 8, 1, (), ("lo",)), None),
    "ifname_unknown": ("NCCL_SOCKET_IFNAME", "eth", IB_NODE, "matches no interface"),
    "ifname_prefix": ("NCCL_SOCKET_IFNAME", "ens", IB_NODE, None),
    "ifname_exclusion": ("NCCL_SOCKET_IFNAME", "^docker,lo", IB_NODE, None),
    "gdr_off_across_ib_nodes": ("NCCL_NET_GDR_LEVEL", "LOC", IB_NODE, "GPUDirect RDMA off"),
    "gdr_number_zero": ("NCCL_NET_GDR_LEVEL", "0", IB_NODE, "GPUDirect RDMA off"),
    "gdr_level_ok": ("NCCL_NET_GDR_LEVEL", "PHB", IB_NODE, None),
    "gdr_level_invalid": ("NCCL_NET_GDR_LEVEL", "FAST", IB_NODE, "is no GPUDirect RDMA level"),
    "visible_empty": ("CUDA_VISIBLE_DEVICES", "", IB_NODE, "hides every GPU"),
    "visible_twice": ("CUDA_VISIBLE_DEVICES", "0,1,1,2,3,4,5,6", IB_NODE, "twice"),
    "visible_absent_gpu": ("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,8", IB_NODE, "names GPU 8"),
    "visible_too_few": ("CUDA_VISIBLE_DEVICES", "0,1,2,3", IB_NODE, "4 GPU(s) to 8 ranks"),
    "visible_uuids": ("CUDA_VISIBLE_DEVICES", ",".join(f"GPU-{i}" for i in range(8)), IB_NODE, None),
}


@pytest.mark.parametrize("name", HINTS)
def test_nccl_variable_hint(name):
    variable, value, facts, words = HINTS[name]
    hint = dict((n, h) for n, _, h in env_hints({variable: value}, facts))[variable]
    if words is None:
        assert hint is None, hint
    else:
        assert hint is not None and words in hint, hint


def test_unset_variables_are_listed_without_hints():
    rows = env_hints({}, IB_NODE)
    assert [n for n, _, _ in rows] == [
        "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE", "NCCL_NET_GDR_LEVEL", "CUDA_VISIBLE_DEVICES",
    ]  # fmt: skip
    assert all(value is None and hint is None for _, value, hint in rows)


# ---- bad input: one line, before any process starts ----------------------------------------------------
@pytest.mark.parametrize(
    "args, words",
    [
        (["--devices", "1"], "--devices 1 is invalid"),
        (["--devices", "4", "--mesh", "tp=3"], "parallel dims"),
        (["--devices", "4", "--mesh", "tp2"], "--mesh 'tp2'"),
        (["--devices", "4", "--sizes", "1M,0"], "message size '0' is invalid"),
        (["--devices", "4", "--gpus-per-node", "3"], "--gpus-per-node 3 does not divide"),
        (["--devices", "4", "--iters", "0"], "--iters 0 is invalid"),
        (["--devices", "4", "--rounds", "0"], "--rounds 0 is invalid; allowed: an int from 1 to"),
    ],
)
def test_bad_doctor_input_is_one_line_before_spawning(args, words, capsys, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    assert cli.main(["doctor", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainer: error: ") and words in err and "\n" not in err, err


def test_doctor_is_in_the_cli_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "trainer doctor --devices 4" in capsys.readouterr().out
