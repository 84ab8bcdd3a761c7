"""Whole files: one process writes the model (safetensors), the optimizer and the trainer state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from strategies.checkpoint_io import (
    Optimizers,
    checked_state,
    checkpointed_state_dict,
    checks_frozen_parameters,
    load_optimizer_state,
    optimizer_state,
)
from trainer import checkpoint as ckpt


class WholeFiles:
    """The layout of one process: every tensor in one file per kind, written atomically."""

    layout = "files"
    in_progress = False

    def save(
        self, path: Path, module: nn.Module, optimizer: Optimizers | None, state: dict[str, Any]
    ) -> None:
        """Write model, optimizer(s) and `state` as one atomic checkpoint directory of whole files."""
        model_sd = checkpointed_state_dict(module)
        optim_sd = optimizer_state(optimizer) if optimizer is not None else None

        def write(tmp: Path) -> ckpt.Entries:
            entries = ckpt.save_model_file(model_sd, tmp / ckpt.MODEL_FILE)
            if optim_sd is not None:
                entries |= ckpt.save_torch_file(optim_sd, tmp / ckpt.OPTIMIZER_FILE)
            return entries | ckpt.save_torch_file(state, tmp / ckpt.STATE_FILE)

        ckpt.write_atomically(Path(path), write, ckpt.meta_for(state))

    def load(self, path: Path, module: nn.Module, optimizer: Optimizers | None) -> dict[str, Any]:
        """The whole model (and optimizer(s)) into `module` (and `optimizer`), as every rank holds them."""
        load_module_state(module, ckpt.load_model_file(path / ckpt.MODEL_FILE), path)
        if optimizer is not None:
            load_optimizer_state(optimizer, ckpt.load_torch_file(path / ckpt.OPTIMIZER_FILE), path)
        return checked_state(path)

    def finish(self) -> None:
        """Nothing is written in the background."""


def load_module_state(module: nn.Module, state_dict: dict[str, torch.Tensor], source: Path) -> None:
    """`load_state_dict(strict=True)` of what the module checkpoints, whose error names the checkpoint and the
    keys that don't match."""
    own = checkpointed_state_dict(module)
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    wrong_shape = sorted(k for k in set(own) & set(state_dict) if own[k].shape != state_dict[k].shape)
    if missing or unexpected or wrong_shape:
        parts = [
            f"{label} {keys[:3]}{' ...' if len(keys) > 3 else ''}"
            for label, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("wrong shape", wrong_shape),
            )
            if keys
        ]
        raise ckpt.CheckpointError(
            f"checkpoint '{source}' does not fit {type(module).__name__}: {'; '.join(parts)}"
        )
    module.load_state_dict(state_dict, strict=checks_frozen_parameters(module))  # the keys were checked above
