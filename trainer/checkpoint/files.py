"""Checkpoint files: safetensors weights and `weights_only` torch files, each hashed as it is written.

Loading never unpickles beyond an allow-list (safetensors; `torch.load(weights_only=True)`), so a forged
file is refused, naming it, instead of running code.
"""

from __future__ import annotations

import json
import pickle
import re
import struct
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from trainer.checkpoint import integrity
from trainer.checkpoint.layout import CheckpointError, Entries

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def save_model_file(state_dict: dict[str, torch.Tensor], path: Path) -> Entries:
    """Write tensors as safetensors, streamed through the hash one tensor at a time (no whole-file buffer);
    tensors sharing memory (tied weights) are stored once, as aliases. Returns the file's manifest entry."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"state_dict entry {name!r} is a {type(value).__name__}; only tensors can be saved"
            )
        if value.dtype not in _ST_DTYPES:
            raise CheckpointError(
                f"state_dict entry {name!r} has dtype {value.dtype}; allowed: {', '.join(map(str, _ST_DTYPES))}"
            )
        key = (
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            tuple(value.stride()),
        )
        if key in seen and value.numel() > 0:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = value.detach()
    header: dict[str, Any] = {"__metadata__": {"aliases": json.dumps(aliases)}}
    offset = 0
    for name, t in tensors.items():
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the tensor data starts 8-byte aligned
    with integrity.HashingFile(path) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():  # one tensor at a time; copied only when not contiguous or not on the CPU
            f.write(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return {path.name: f.entry()}


def load_model_file(path: Path) -> dict[str, torch.Tensor]:
    """Read what `save_model_file` wrote (aliases restored as references to the same tensor)."""
    path = Path(path)
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint file {path} is unreadable, truncated or corrupted ({err})"
        ) from err
    for name, target in aliases.items():
        tensors[name] = tensors[target]
    return tensors


def save_torch_file(obj: Any, path: Path) -> Entries:
    """`torch.save`, hashed while written; returns the file's manifest entry."""
    path = Path(path)
    with integrity.HashingFile(path) as f:
        try:
            torch.save(obj, f)
        except Exception as err:
            f.raise_write_error(err)
    return {path.name: f.entry()}


def load_torch_file(path: Path, mmap: bool = False) -> Any:
    """`torch.load` that never runs code from the file and says which file is broken (`mmap`: its tensors
    mapped, not read)."""
    try:
        with warnings.catch_warnings():  # a plain pickle (never torch.save's) draws a protocol warning
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete") from err
    except pickle.UnpicklingError as err:  # weights_only refused a global: loading it could run code
        found = re.search(r"(?:Unsupported global: |unsupported )GLOBAL (\S+)", str(err))
        what = f"the global {found.group(1)}" if found else "an object outside the allow-list"
        raise CheckpointError(
            f"checkpoint file {path} is refused: it holds {what}, which only an unrestricted unpickler "
            "would load (and could run code); allowed: tensors and plain Python values",
            reason="refused: holds objects outside the allow-list",
        ) from None  # torch's chained advice (load it with weights_only=False) is never shown
    except Exception as err:  # torch raises RuntimeError/EOFError for damaged files
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint file {path} is unreadable, truncated or corrupted ({first})"
        ) from err


def check_pickled_files(ckpt_dir: Path, names: Any) -> None:
    """Every torch-pickled file among `names` unpickled through the allow-list, its tensors mapped and never
    read: a command that does not load a file (validate reads no optimizer) still refuses a forged one, whose
    hash its forger may have rewritten too."""
    for name in names:
        if str(name).endswith(".pt"):
            load_torch_file(Path(ckpt_dir) / name, mmap=True)
