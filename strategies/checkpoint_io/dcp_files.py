"""Sharded checkpoints through torch.distributed.checkpoint (DCP): each rank writes only what it holds
(FSDP shards, ZeRO-1 optimizer slices, its share of replicated tensors) into its own files under `dcp/`,
hashed while written, and reads back what its new shards need, whatever world size wrote them.
Reading goes through trainer/checkpoint/safe_dcp.py, which never runs code from the files.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from strategies.checkpoint_io import Optimizers, checks_frozen_parameters
from trainer import checkpoint as ckpt
from trainer.checkpoint import safe_dcp
from trainer.checkpoint.integrity import HashingFile


class _HashingFileSystem(FileSystem):
    """DCP's file system with every file opened for writing hashed as it is written."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root, self.entries = Path(root), {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = HashingFile(Path(path))
        try:
            yield stream
        except Exception as err:  # DCP's torch.save wraps a full disk in its own error: say the real one
            stream.raise_write_error(err)
        finally:
            stream.close()
        self.entries[self._key(path)] = stream.entry()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata under a temporary name first
        self.entries[self._key(new_path)] = self.entries.pop(self._key(path))

    def _key(self, path: str | os.PathLike) -> str:
        return Path(path).relative_to(self.root).as_posix()


class HashingWriter(dcp.FileSystemWriter):
    """A DCP writer into `<checkpoint>/dcp` whose `entries` are the manifest entries of the files this
    rank wrote (paths relative to the checkpoint directory)."""

    def __init__(self, ckpt_dir: Path) -> None:
        super().__init__(str(Path(ckpt_dir) / ckpt.DCP_DIR))
        self.fs = _HashingFileSystem(Path(ckpt_dir))

    @property
    def entries(self) -> ckpt.Entries:
        return self.fs.entries


def load(payload: dict[str, Any], path: Path, group: Any) -> None:
    """Fill `payload` (this rank's tensors, sharded as they are now) from the checkpoint at `path`; a
    checkpoint that does not fit becomes a one-line CheckpointError."""
    reader = safe_dcp.SafeReader(path)
    reader.read_metadata()  # refused here in one line: inside dcp.load it would be logged as tracebacks
    try:
        safe_dcp.load(payload, reader, group)
    except CheckpointException as err:  # a BaseException carrying each rank's planner error (and traceback)
        first = next(iter(err.failures.values()))
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, ckpt.CheckpointError):
            raise ckpt.CheckpointError(str(first), first.reason) from None
        raise ckpt.CheckpointError(f"checkpoint '{path}' does not fit this model: {first}") from None


def load_state_dict_layout(path: Path, module: nn.Module, optimizer: Optimizers | None, group: Any) -> None:
    """Load a checkpoint of the "state_dict" layout (DDP, FSDP stages 2/3, 3D) into `module` and
    `optimizer` as they are sharded now, by any strategy and world size (`group` None: one process). A module
    that does not checkpoint its frozen parameters gets the others (every one of them, or DCP's load fails)."""
    skip_frozen = not checks_frozen_parameters(module)
    model_sd, optim_sd = get_state_dict(
        module, optimizer or [], options=StateDictOptions(ignore_frozen_params=skip_frozen)
    )
    payload = {"model": model_sd, "optim": optim_sd} if optimizer is not None else {"model": model_sd}
    load(payload, path, group)
    set_state_dict(
        module,
        optimizer or [],
        model_state_dict=payload["model"],
        optim_state_dict=payload.get("optim", {}),
        options=StateDictOptions(strict=not skip_frozen, ignore_frozen_params=skip_frozen),
    )


def saved_entries(path: Path) -> dict[str, Any]:
    """{flattened key: DCP storage metadata} of a sharded checkpoint (what was saved, with global shapes)."""
    return safe_dcp.SafeReader(path).read_metadata().state_dict_metadata
