"""DCP state dict: every rank writes its own shards into `dcp/` (torch.distributed.checkpoint), hashed as
written; nothing is gathered, and any world size reads them back (strategies/checkpoint_io/dcp_files.py).
torch.distributed.checkpoint is imported by the first save or load (~0.7 s of start-up with DTensor): every
mesh strategy holds this layout, and a run that never saves or resumes need not load it."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from strategies.checkpoint_io import Optimizers, checked_state, checks_frozen_parameters
from trainer import checkpoint as ckpt

if TYPE_CHECKING:
    from strategies.base import Strategy
    from strategies.checkpoint_io.dcp_files import HashingWriter


class ShardedState:
    """The layout of torch's `get_state_dict` (keyed by parameter name; DTensor shards under sharding),
    written by the ranks of `strategy`; with its `async_save` in the background."""

    layout = "state_dict"

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self._pending: Any = None  # (future, finish, staging dir, path) of a background save
        self._save_group: Any = None  # the background writer's own process group

    def payload(self, module: nn.Module, optimizer: Optimizers | None) -> dict[str, Any]:
        """What the ranks write: replicated tensors are written once, spread over the ranks by DCP (frozen
        parameters only when the module checkpoints them); several optimizers' states are keyed by parameter
        name together, as torch's `get_state_dict` keys them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(ignore_frozen_params=not checks_frozen_parameters(module))
        model_sd, optim_sd = get_state_dict(module, optimizer or [], options=options)
        return {"model": model_sd, **({"optim": optim_sd} if optimizer is not None else {})}

    def save(
        self, path: Path, module: nn.Module, optimizer: Optimizers | None, state: dict[str, Any]
    ) -> None:
        """Every rank writes its part into `dcp/`, hashed as written; rank zero then adds the trainer state
        and the manifest of every rank's files, and renames the directory into place. In the background,
        the checkpoint completes at `finish`."""
        import torch.distributed.checkpoint as dcp

        from strategies.checkpoint_io.dcp_files import HashingWriter

        strategy = self.strategy
        self.finish()
        path = Path(path)
        meta = ckpt.meta_for(state, format="dcp", layout=self.layout)
        tmp = ckpt.staging_dir(path, meta)  # named for its owner: a concurrent or dead writer's is another
        refused = None
        if strategy.is_global_zero:
            try:
                ckpt.refuse_foreign(path, meta)
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
            except (ckpt.CheckpointError, OSError) as err:
                refused = str(err)
        payload = self.payload(module, optimizer)
        strategy.begin_io(ckpt.tensor_bytes(payload))
        refused = strategy.agree(refused)  # also the barrier: the directory is clean before anyone writes
        if refused is not None:
            raise ckpt.CheckpointError(refused)
        writer = HashingWriter(tmp)
        finish = functools.partial(self._finish_save, tmp, path, state, meta, writer)
        if not getattr(strategy, "async_save", False):
            try:
                dcp.save(payload, storage_writer=writer, process_group=strategy.io_group)
            except BaseException as err:
                self._abandon_save(tmp, path, err)
            return finish()
        if self._save_group is None:  # its own: the writer's collectives must not interleave with training's
            self._save_group = dist.new_group(backend="gloo")
        future = dcp.async_save(payload, storage_writer=writer, process_group=self._save_group)
        self._pending = (future, finish, tmp, path)

    def _finish_save(
        self, tmp: Path, path: Path, state: dict, meta: dict[str, Any], writer: HashingWriter
    ) -> None:
        strategy = self.strategy
        written = {k: v for entries in strategy.io_gather(writer.entries) for k, v in entries.items()}
        failed = None
        if strategy.is_global_zero:
            try:  # it removes the staged directory itself when it fails
                ckpt.write_atomically(
                    path,
                    lambda d: ckpt.save_torch_file(state, d / ckpt.STATE_FILE),
                    meta,
                    staged=tmp,
                    written=written,
                )
            except Exception as err:
                failed = err
        problem = strategy.agree(None if failed is None else str(failed))  # every rank fails together
        if failed is not None:
            raise failed
        if problem is not None:
            raise ckpt.CheckpointError(problem)

    def _abandon_save(self, tmp: Path, path: Path, err: BaseException) -> None:
        """After DCP's write failed (on every rank at once: it gathers the ranks' results), rank zero
        removes the staged directory; the error is raised as the user should read it (a full disk: one line)."""
        reached = ckpt.dir_bytes(tmp)
        if self.strategy.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        said = ckpt.save_error(err, path, reached)
        if said is err:
            raise err
        raise said from err

    @property
    def in_progress(self) -> bool:
        return self._pending is not None

    def finish(self) -> None:
        if self._pending is not None:
            future, finish, tmp, path = self._pending
            self._pending = None
            try:
                future.result()
            except BaseException as err:
                self._abandon_save(tmp, path, err)
            finish()

    def load(self, path: Path, module: nn.Module, optimizer: Optimizers | None) -> dict[str, Any]:
        """Fill `module` and `optimizer`, sharded as they are now, each rank reading what its shards need."""
        self.load_parts(path, module, optimizer)
        return checked_state(path)

    def load_parts(self, path: Path, module: nn.Module, optimizer: Optimizers | None) -> None:
        """The model and optimizer part of `load`."""
        from strategies.checkpoint_io import dcp_files

        strategy = self.strategy
        strategy.reshard(module)  # gathered copies from an earlier forward would hide what is loaded
        strategy.begin_io(ckpt.manifest_bytes(path) // strategy.world_size)
        dcp_files.load_state_dict_layout(path, module, optimizer, strategy.io_group)
