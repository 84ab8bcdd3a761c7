"""ZeRO-1 slices: the replicated model as a DCP state dict, each rank's optimizer slices as they are (no
gather), re-sliced for any world size on load (strategies/techniques/zero1/sliced_parameters.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from strategies.checkpoint_io import checked_state, checkpointed_state_dict
from strategies.checkpoint_io.sharded_state import ShardedState
from strategies.checkpoint_io.whole_files import load_module_state
from strategies.techniques.zero1.sliced_parameters import SlicedParameters
from trainer import checkpoint as ckpt

if TYPE_CHECKING:
    from strategies.mesh import MeshStrategy


class Zero1Slices(ShardedState):
    """The layout of ZeRO-1 (`sliced()`: the optimizer's slices, made once the optimizer exists)."""

    layout = "zero1"

    def __init__(self, strategy: MeshStrategy, sliced: Callable[[], SlicedParameters]) -> None:
        super().__init__(strategy)
        self.sliced = sliced

    def payload(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        if optimizer is None:
            return {"model": checkpointed_state_dict(module)}
        return {
            "model": checkpointed_state_dict(module),
            "optim": self.sliced().sharded_state_dict(self._mesh),
        }

    def load_parts(self, path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        # DCP: imported by the first load (sharded_state.py says why)
        from strategies.checkpoint_io import dcp_files

        strategy = self.strategy
        strategy.begin_io(ckpt.manifest_bytes(path) // strategy.world_size)
        load = functools.partial(dcp_files.load, path=path, group=strategy.io_group)
        load({"model": checkpointed_state_dict(module)})
        if optimizer is not None:
            self.sliced().load_sharded(dcp_files.saved_entries(path), load, self._mesh)

    def load_whole_files(
        self, path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> dict[str, Any]:
        """A ZeRO-1 checkpoint of whole files (as saved before sharded saves): the full optimizer state,
        sliced for this rank."""
        load_module_state(module, ckpt.load_model_file(path / ckpt.MODEL_FILE), path)
        if optimizer is not None:
            self.sliced().load_full_state_dict(ckpt.load_torch_file(path / ckpt.OPTIMIZER_FILE))
        return checked_state(path)

    @property
    def _mesh(self) -> Any:
        return self.strategy.mesh.mesh("dense")  # the ranks the slices are spread over
