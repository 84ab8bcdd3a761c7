"""LoRA adapters kept as adapters: which base model they belong to (a hash of its weight files' bytes and
of its config; its folder is where to find it again), the refusal to resume them onto another, and PEFT's
own layout (adapter_config.json + adapter_model.safetensors, what `peft.PeftModel.from_pretrained(base,
folder)` loads). The weights are hashed with the checkpoints' own XXH3 blocks (trainer.checkpoint.integrity): a copy
of the base in another folder is the same base, weights rewritten in place are another."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.checkpoint import integrity

# config fields that say nothing about the base weights: set per fine-tune or per transformers version
_NOT_IDENTITY = {
    "transformers_version", "_name_or_path", "architectures", "id2label", "label2id", "num_labels",
    "pad_token_id", "torch_dtype", "dtype", "problem_type", "_attn_implementation_autoset",
}  # fmt: skip
WEIGHTS = "weights_xxh3_128"  # the identity's key: a digest of the weight files' block hashes
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # the files from_pretrained reads weights from


def base_identity(source: Any, config: Any, hash_weights: bool = False) -> dict[str, str | None]:
    """{"path": the base model's folder (None when built from a config or an instance), "config_sha256",
    WEIGHTS: with `hash_weights`, the digest of the folder's weight files (else None)}."""
    path = Path(source).resolve() if isinstance(source, (str, os.PathLike)) else None
    fields = {k: v for k, v in config.to_dict().items() if k not in _NOT_IDENTITY}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    weights = weights_digest(path) if hash_weights and path is not None else None
    return {"path": None if path is None else str(path), "config_sha256": digest, WEIGHTS: weights}


def weights_digest(folder: Path) -> str:
    """A digest of the weight files in `folder`: their names, sizes and XXH3 block hashes (at the speed
    of the disk); the same for a byte-identical copy anywhere, another for any changed byte."""
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in _WEIGHT_SUFFIXES)
    digest = hashlib.sha256()
    for file in files:
        entry = integrity.hash_file(file)
        digest.update(json.dumps([file.name, entry["bytes"], entry[integrity.HASH]]).encode())
    return digest.hexdigest()


class BaseModelMismatch(ValueError):
    """A LoRA checkpoint resumed over another base model than the one its adapters were trained on."""


def check_same_base(saved: dict[str, Any] | None, own: dict[str, Any]) -> None:
    """Refuse, in one line naming both, a checkpoint whose adapters were trained on another base model: other
    weights or config, wherever its folder is (checkpoints saved before weights were hashed: another
    folder or config)."""
    if saved is None:
        return
    if saved.get(WEIGHTS) is not None:
        same = saved[WEIGHTS] == own.get(WEIGHTS) and saved["config_sha256"] == own["config_sha256"]
    else:
        same = saved.get("path") == own.get("path") and saved["config_sha256"] == own["config_sha256"]
    if same:
        return
    changed = " (its weights changed since)" if saved.get("path") == own.get("path") else ""
    raise BaseModelMismatch(
        f"the checkpoint's adapters were trained on base model {_name(saved)}, not on this HFModule's "
        f"{_name(own)}{changed}; allowed: resume with HFModule(model=<that base>) (or start a new run)"
    )


def _name(identity: dict[str, Any]) -> str:
    weights = f", weights {identity[WEIGHTS][:12]}" if identity.get(WEIGHTS) else ""
    return (
        f"{identity.get('path') or '(built from a config)'} (config sha256 {identity['config_sha256'][:12]}"
        f"{weights})"
    )


def peft_wrap(model: nn.Module, config: Any) -> nn.Module:
    """`peft.get_peft_model(model, config)`, without the FutureWarning transformers raises when peft reads its
    deprecated `is_gradient_checkpointing` (peft's call, nothing the user can act on; it was a good run's
    last line)."""
    import peft

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(model, config)


def write_adapter(peft_model: nn.Module, state: dict[str, torch.Tensor], out_dir: Path) -> None:
    """PEFT's `save_pretrained` of the adapters in `state` (the wrapper's full state dict, gathered when it
    was sharded): adapter_config.json and adapter_model.safetensors in `out_dir`."""
    peft_model.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
