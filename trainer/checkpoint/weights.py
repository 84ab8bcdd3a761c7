"""The full, unsharded model weights of a checkpoint of any layout, read in this one process.

Whole-file checkpoints hold them in `model.safetensors`; sharded ones (DCP state dict, ZeRO-1) hold each
rank's shards under `dcp/`, which DCP's reader assembles without a process group, whatever world size wrote
them. Every read is safe: safetensors, `weights_only` torch files, DCP metadata through an allow-list
(trainer/checkpoint/safe_dcp.py). What `load_from_checkpoint`, `Trainer.full_state_dict` and `trainer export` read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint as ckpt


def read_checkpoint(ckpt_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the full model weights on the CPU, the trainer state) of a checkpoint, verified as a resume would
    verify it (hashes, manifest, validation); a `last` link reads the checkpoint it names."""
    ckpt_dir = Path(ckpt_dir)
    meta = ckpt.check_good(ckpt_dir)
    ckpt.check_pickled_files(ckpt_dir, meta.get("manifest", {}))  # the optimizer it never reads, too
    state = ckpt.load_torch_file(ckpt_dir / ckpt.STATE_FILE)
    ckpt.check_step(ckpt_dir, state)
    if meta.get("format") == "dcp":
        return dcp_model_state(ckpt_dir), state
    return ckpt.load_model_file(ckpt_dir / ckpt.MODEL_FILE), state


def dcp_model_state(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The full model tensors of a DCP checkpoint, in one process, whatever world size wrote it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainer.checkpoint import safe_dcp

    reader = safe_dcp.SafeReader(ckpt_dir)
    entries = reader.read_metadata().state_dict_metadata
    odd = [
        k for k, m in entries.items() if k.startswith("model.") and not isinstance(m, TensorStorageMetadata)
    ]
    if odd:  # skipping it would give an incomplete model without a word
        raise ckpt.CheckpointError(
            f"checkpoint '{ckpt_dir}': model entry {odd[0]!r} is not stored as a tensor; a model is read "
            "only whole, from tensors"
        )
    template = {
        key: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for key, m in entries.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    nested = {"model": {k[len("model.") :]: v for k, v in template.items()}}
    safe_dcp.load(nested, reader, no_dist=True)
    return nested["model"]
