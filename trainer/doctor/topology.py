"""A node's GPUs through NVML: how each pair is connected (NVLink, NVSwitch, or the PCIe path, as
`nvidia-smi topo -m` names it), each GPU's PCIe link, and its error state (uncorrected ECC, remapped rows,
critical XIDs seen while the doctor ran: read by callbacks.gpu_health's NvmlReader)."""

from __future__ import annotations

import dataclasses
from typing import Any

from callbacks.gpu_health import APPLICATION_XIDS, NvmlReader

# nvmlDeviceGetTopologyCommonAncestor's levels, by nvidia-smi's names for them
PCIE_PATHS = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
NVLINK_DEVICE_TYPE_SWITCH = 2  # nvmlDeviceGetNvLinkRemoteDeviceType: 0 GPU, 1 IBM NPU, 2 NVSwitch


@dataclasses.dataclass(frozen=True)
class GPUInfo:
    """One GPU of the node: its name, PCIe link, NVLinks, and error state."""

    index: int
    name: str
    bus_id: str
    pcie_gen: int | None
    pcie_width: int | None
    nvlinks: int  # active links
    ecc_uncorrected: int | None
    rows_pending: bool
    rows_failed: bool
    xids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class NodeTopology:
    """The GPUs of one node and how each pair is connected: "NV<k>" (k direct NVLinks), "NVSwitch", or a
    PCIe path ("PIX", "PXB", "PHB", "NODE", "SYS")."""

    host: str
    gpus: tuple[GPUInfo, ...]
    links: dict[tuple[int, int], str]

    @property
    def nvlink(self) -> bool:
        """Whether every pair of GPUs talks over NVLink (directly or through NVSwitch)."""
        return bool(self.links) and all(kind.startswith("NV") for kind in self.links.values())

    def problems(self) -> list[str]:
        """One line per GPU error that needs attention."""
        found = []
        for gpu in self.gpus:
            where = f"{self.host} GPU {gpu.index} ({gpu.bus_id})"
            if gpu.ecc_uncorrected:
                found.append(
                    f"{where}: {gpu.ecc_uncorrected} uncorrected ECC error(s) since the driver loaded"
                )
            if gpu.rows_failed:
                found.append(f"{where}: memory row remapping failed: replace this GPU")
            elif gpu.rows_pending:
                found.append(f"{where}: memory rows are pending remapping: reset this GPU")
            critical = [x for x in gpu.xids if x not in APPLICATION_XIDS]
            if critical:
                found.append(
                    f"{where}: critical XID error(s) {', '.join(map(str, critical))} during the test"
                )
        return found


class NodeProbe:
    """Opened before the collectives run (XIDs are seen from then on), read after them."""

    def __init__(self, nvml: Any, host: str) -> None:
        self.nvml, self.host = nvml, host
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.readers = []
        for handle in self.handles:
            nvml.nvmlInit()  # NVML counts its sessions: each reader closes its own
            self.readers.append(NvmlReader(nvml, handle))

    def read(self) -> NodeTopology:
        """The topology and every GPU's state now; closes NVML."""
        nvml = self.nvml
        try:
            bus_ids = [_text(nvml.nvmlDeviceGetPciInfo(h).busId) for h in self.handles]
            direct = [self._nvlinks(h, bus_ids) for h in self.handles]
            gpus = []
            for i, (handle, reader) in enumerate(zip(self.handles, self.readers, strict=True)):
                reading = reader.read()
                gpus.append(
                    GPUInfo(
                        index=i,
                        name=_text(nvml.nvmlDeviceGetName(handle)),
                        bus_id=bus_ids[i],
                        pcie_gen=self._optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
                        pcie_width=self._optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
                        nvlinks=len(reader.links),
                        ecc_uncorrected=reading.ecc_uncorrected,
                        rows_pending=reading.rows_pending,
                        rows_failed=reading.rows_failed,
                        xids=reading.xids,
                    )
                )
            links = {}
            for i in range(len(self.handles)):
                for j in range(i + 1, len(self.handles)):
                    links[(i, j)] = self._link(i, j, bus_ids, direct)
            return NodeTopology(self.host, tuple(gpus), links)
        finally:
            for reader in self.readers:
                reader.close()
            nvml.nvmlShutdown()

    def _nvlinks(self, handle: Any, bus_ids: list[str]) -> dict[str, int]:
        """Active NVLinks of one GPU by what is at the other end: a GPU's bus id, or "switch"."""
        nvml, ends = self.nvml, {}
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                if not nvml.nvmlDeviceGetNvLinkState(handle, link):
                    continue
                remote = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
            except nvml.NVMLError:  # no NVLink, or past the last link
                continue
            end = remote if remote in bus_ids else "switch"
            ends[end] = ends.get(end, 0) + 1
        return ends

    def _optional(self, function: Any, handle: Any) -> Any:
        """`function(handle)`, or None where this GPU does not expose it."""
        try:
            return function(handle)
        except self.nvml.NVMLError:
            return None

    def _link(self, i: int, j: int, bus_ids: list[str], direct: list[dict[str, int]]) -> str:
        count = direct[i].get(bus_ids[j], 0)
        if count:
            return f"NV{count}"
        if direct[i].get("switch") and direct[j].get("switch"):
            return "NVSwitch"
        level = self.nvml.nvmlDeviceGetTopologyCommonAncestor(self.handles[i], self.handles[j])
        return PCIE_PATHS.get(level, f"PCIe level {level}")


def _text(value: Any) -> str:
    """pynvml answers bytes in old versions and str in new ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def load_nvml() -> tuple[Any, str | None]:
    """The pynvml module, or None and why not."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    return pynvml, None
