"""LoRA adapters kept as adapters: which base model they belong to (its folder and a hash of its config),
the refusal to resume them onto another, and PEFT's own layout (adapter_config.json +
adapter_model.safetensors, what `peft.PeftModel.from_pretrained(base, folder)` loads)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

# config fields that say nothing about the base weights: set per fine-tune or per transformers version
_NOT_IDENTITY = {
    "transformers_version", "_name_or_path", "architectures", "id2label", "label2id", "num_labels",
    "pad_token_id", "torch_dtype", "dtype", "problem_type", "_attn_implementation_autoset",
}  # fmt: skip


def base_identity(source: Any, config: Any) -> dict[str, str | None]:
    """{"path": the base model's folder (None when built from a config or an instance), "config_sha256"}."""
    path = str(Path(source).resolve()) if isinstance(source, (str, os.PathLike)) else None
    fields = {k: v for k, v in config.to_dict().items() if k not in _NOT_IDENTITY}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    return {"path": path, "config_sha256": digest}


def check_same_base(saved: dict[str, Any] | None, own: dict[str, Any]) -> None:
    """Refuse, in one line naming both, a checkpoint whose adapters were trained on another base model."""
    if saved is None or saved == own:
        return
    raise ValueError(
        f"the checkpoint's adapters were trained on base model {_name(saved)}, not on this HFModule's "
        f"{_name(own)}; allowed: resume with HFModule(model=<that base>) (or start a new run)"
    )


def _name(identity: dict[str, Any]) -> str:
    return (
        f"{identity.get('path') or '(built from a config)'} (config sha256 {identity['config_sha256'][:12]})"
    )


def write_adapter(peft_model: nn.Module, state: dict[str, torch.Tensor], out_dir: Path) -> None:
    """PEFT's `save_pretrained` of the adapters in `state` (the wrapper's full state dict, gathered when it
    was sharded): adapter_config.json and adapter_model.safetensors in `out_dir`."""
    peft_model.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
