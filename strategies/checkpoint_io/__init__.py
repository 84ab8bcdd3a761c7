"""Checkpoint layouts: how a strategy's ranks write a checkpoint directory and read it back. Each layout
is one CheckpointIO (whole files, DCP state dict, ZeRO-1 slices); a strategy writes one and reads those
it can (`Strategy.checkpoint_io`, `Strategy.checkpoint_readers`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from trainer import checkpoint as ckpt

LAYOUTS = {  # every layout, by who writes it
    "files": "written as whole files (one process)",
    "state_dict": "written by ddp, dp_sgd, fsdp with zero_stage 2/3 or parallel3d",
    "zero1": "written by fsdp with zero_stage=1",
}


# what a checkpoint holds as its optimizer state: the fit's optimizer, or a manually optimized module's several
Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer]


class CheckpointIO(Protocol):
    """One checkpoint layout: save on every rank (each writes its part), load in place on every rank."""

    layout: str  # a key of LAYOUTS, recorded in meta.json

    def save(
        self, path: Path, module: nn.Module, optimizer: Optimizers | None, state: dict[str, Any]
    ) -> None:
        """Write model, optimizer(s) and the trainer `state` as one atomic checkpoint directory."""

    def load(self, path: Path, module: nn.Module, optimizer: Optimizers | None) -> dict[str, Any]:
        """Fill `module` and `optimizer` in place from `path`; returns the trainer state."""

    @property
    def in_progress(self) -> bool:
        """True while a checkpoint is still being written in the background."""

    def finish(self) -> None:
        """Block until a checkpoint written in the background is complete (every rank calls it)."""


def layout_of(path: Path) -> str:
    """The layout of the checkpoint at `path`, from its meta.json (sharded ones before layouts were fsdp's)."""
    meta = ckpt.read_meta(path)
    return meta.get("layout", "state_dict") if meta.get("format") == "dcp" else "files"


def checks_frozen_parameters(module: nn.Module) -> bool:
    """Whether `module`'s checkpoints hold its frozen parameters (requires_grad False): True unless the module
    declares `checkpoint_frozen_parameters() -> False`, as one whose frozen weights come back from elsewhere
    (LoRA adapters over a base model read from its folder) does."""
    declared = getattr(module, "checkpoint_frozen_parameters", None)
    return bool(declared()) if callable(declared) else True


def checkpointed_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` less the frozen parameters when the module declares they are not checkpointed."""
    state = module.state_dict()
    if checks_frozen_parameters(module):
        return state
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def checked_state(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer state, whose step must be the one its meta.json announces."""
    state = ckpt.load_torch_file(path / ckpt.STATE_FILE)
    ckpt.check_step(path, state)
    return state


def read_checkpoint(
    path: Path,
    module: nn.Module,
    optimizer: Optimizers | None,
    readers: dict[str, Callable[..., dict[str, Any]]],
    reader_name: str,
) -> dict[str, Any]:
    """Load `path` in place with the reader of its layout among `readers` (Strategy.checkpoint_readers); a
    one-line error names a layout `reader_name` cannot read and those it can."""
    layout = layout_of(path)
    if layout not in readers:
        reads = " or ".join(LAYOUTS[name] for name in readers)
        raise ckpt.CheckpointError(
            f"checkpoint '{path}' was {LAYOUTS[layout]}; this {reader_name} reads checkpoints "
            f"{reads}: resume with one of those (any world size), or `trainer export` its weights"
        )
    return readers[layout](path, module, optimizer)


def optimizer_state(optimizer: Optimizers) -> dict[str, Any]:
    """The whole state of the optimizer, or of several as {"optimizers": [each one's state, in order]}."""
    if isinstance(optimizer, list):
        return {"optimizers": [o.state_dict() for o in optimizer]}
    return optimizer.state_dict()


def load_optimizer_state(optimizer: Optimizers, state: dict[str, Any], source: Path) -> None:
    """`optimizer_state`'s inverse; a checkpoint of another number of optimizers is refused in one line."""
    several = state.get("optimizers")
    count = len(optimizer) if isinstance(optimizer, list) else 1
    if (several is None) != (count == 1) or (several is not None and len(several) != count):
        saved = 1 if several is None else len(several)
        raise ckpt.CheckpointError(
            f"checkpoint '{source}' holds the state of {saved} optimizer(s), configure_optimizers returned "
            f"{count}; allowed: the optimizers the checkpointed run had"
        )
    for one, one_state in zip(
        optimizer if isinstance(optimizer, list) else [optimizer], several or [state], strict=True
    ):
        one.load_state_dict(one_state)
