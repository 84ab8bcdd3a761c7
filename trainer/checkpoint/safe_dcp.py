"""Reading torch.distributed.checkpoint (DCP) files without running code from them.

DCP itself unpickles two things freely: `dcp/.metadata` (with `pickle.load`) and each non-tensor item such
as `optim.param_groups.0.lr` (`torch.load(weights_only=False)`), so a crafted file runs code on load. Here
the metadata goes through an unpickler that builds only DCP's metadata classes, `torch.Size`, dtypes,
layouts and paths, and byte items load with `weights_only=True` (tensors DCP already loads that way);
anything else is a one-line CheckpointError naming the file. Every DCP read (resume, validation, rollback,
`trainer export`) goes through `load`, with `SafeReader` and `SafeLoadPlanner`.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from trainer import checkpoint as ckpt

# (module, name) the metadata of a DCP checkpoint is built from; dtypes are checked separately
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP's metadata classes and nothing else (no callable can be reached)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader of `<checkpoint>/dcp`, with the metadata read through the allow-list, once: call
    `read_metadata` before `dcp.load`, whose own call logs a refusal as tracebacks and retries it."""

    def __init__(self, ckpt_dir: Path) -> None:
        super().__init__(str(Path(ckpt_dir) / ckpt.DCP_DIR))
        self.ckpt_dir = Path(ckpt_dir)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = _read_metadata(self.ckpt_dir / ckpt.DCP_DIR / ".metadata")
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def _read_metadata(path: Path) -> Metadata:
    """DCP's metadata at `path`, unpickled through the allow-list; else a one-line CheckpointError naming
    the file (nothing chained: torch's and pickle's own words add nothing the line does not say)."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise ckpt.CheckpointError(
            f"checkpoint file {path} is missing; the checkpoint is incomplete"
        ) from None
    except pickle.UnpicklingError as err:
        raise ckpt.CheckpointError(
            f"checkpoint file {path} is refused: it names {err}, which DCP's metadata never holds "
            "(unpickling it could run code); allowed: DCP's metadata classes, torch.Size, dtypes and paths",
            reason="refused: metadata outside the allow-list",
        ) from None
    except Exception as err:  # truncated or garbled pickle data
        raise ckpt.CheckpointError(f"checkpoint file {path} is unreadable or corrupted ({err})") from None
    if not isinstance(metadata, Metadata):
        raise ckpt.CheckpointError(
            f"checkpoint file {path} is refused: it holds a {type(metadata).__name__}, not DCP metadata"
        )
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor items loaded by `weights_only` (plain values only)."""

    def __init__(self, ckpt_dir: Path) -> None:
        super().__init__()
        self.ckpt_dir = Path(ckpt_dir)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            stored = self.metadata.storage_data.get(read_item.storage_index)
            where = self.ckpt_dir / ckpt.DCP_DIR / stored.relative_path if stored else self.ckpt_dir
            raise ckpt.CheckpointError(
                f"checkpoint file {where} is refused: its item {read_item.storage_index.fqn!r} holds an object "
                "outside the allow-list (loading it could run code); allowed: tensors and plain Python values",
                reason="refused: an item outside the allow-list",
            ) from None  # torch's chained advice (load it with weights_only=False) is never shown
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes puts it, once loaded safely
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(state: dict[str, Any], reader: SafeReader, group: Any = None, no_dist: bool = False) -> None:
    """`dcp.load` of `state` through `reader` and `SafeLoadPlanner`, by the ranks of `group`; in this one
    process without a process group (or with `no_dist`), which DCP would warn about at every read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            state,
            storage_reader=reader,
            planner=SafeLoadPlanner(reader.ckpt_dir),
            process_group=group,
            no_dist=no_dist,
        )
