"""OnExceptionCheckpoint: save a resumable checkpoint when a fit fails with an exception (Lightning's)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from callbacks.base import Checkpoint
from trainer.core.logging import log, rank_zero_info

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class OnExceptionCheckpoint(Checkpoint):
    """When the fit fails, the training state of the last completed step goes to `<dirpath>/<filename>.ckpt`
    (a checkpoint directory, as `Trainer.save_checkpoint` writes them); `fit(..., ckpt_path=that path)`
    continues from it. A name already taken, by an earlier failure or anything else, is never written over:
    the next free `<filename>-v1.ckpt`, `-v2`, ... is used, and none is ever deleted. A failure before the
    fit's first step began (set-up, restore) leaves nothing new to save. Every rank that fails calls it; a
    checkpoint needs all ranks, so it is written when every rank fails (one bug in all of them), as in
    Lightning."""

    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | Path, filename: str = "on_exception") -> None:
        if not filename:
            raise ValueError("OnExceptionCheckpoint got an empty filename; allowed: a name without extension")
        # given now, not at setup: an exception may come at any moment
        self.dirpath = dirpath
        self.filename = filename
        self._fit_started = False

    @property
    def ckpt_path(self) -> str:
        """Where the checkpoint goes when the name is free."""
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._fit_started = True

    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._fit_started = False

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        if not self._fit_started:
            rank_zero_info(
                f"OnExceptionCheckpoint: the fit failed before it started; no checkpoint ({exception!r})"
            )
            return
        # rank zero's choice: a rank that looked later could see the checkpoint the others just wrote
        path = trainer.strategy.broadcast_object(self._free_path() if trainer.is_global_zero else None)
        try:
            trainer.save_checkpoint(path)
        except Exception as err:  # noqa: BLE001 - the fit's own exception is the one that must surface
            log.error(f"OnExceptionCheckpoint: could not save {path} ({type(err).__name__}: {err})")
            return
        rank_zero_info(
            f"OnExceptionCheckpoint: the fit failed at step {trainer.global_step} ({type(exception).__name__}); "
            f"checkpoint {path}; continue with ckpt_path={str(path)!r}"
        )

    def _free_path(self) -> str:
        """`ckpt_path`, or the first `-vN` sibling that nothing occupies."""
        path, version = self.ckpt_path, 0
        while os.path.lexists(path):
            version += 1
            path = os.path.join(self.dirpath, f"{self.filename}-v{version}{self.FILE_EXTENSION}")
        return path
