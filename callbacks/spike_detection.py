"""SpikeDetection: end the fit when the training loss spikes, naming the batches to skip (Lightning's)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from callbacks.loss_window import LossWindow
from trainer import flags

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class TrainingSpikeException(RuntimeError):
    """The fit ended on a loss spike in batch `batch_idx` (of its epoch)."""

    def __init__(self, batch_idx: int) -> None:
        super().__init__(f"Training spike detected in batch {batch_idx}")
        self.batch_idx = batch_idx


class SpikeDetection(Callback):
    """After each step from batch `warmup` of an epoch on, this rank's loss is a spike when it is not an
    improvement on the last good loss (`mode` "min": not lower; "max": not higher) and differs from the mean of
    the last `window` good losses by at least `atol` and by at least `rtol` x that mean (None: no such bound);
    with `finite_only`, a non-finite loss is a spike too (else it is skipped, and kept out of the mean unless
    every rank's is finite). A spike on any rank appends the batch before and the batch itself to the list in
    `exclude_batches_path` (a folder or a .json file; default `<default_root_dir>/skip_batches.json`, written by
    rank zero) and raises TrainingSpikeException on every rank. A step is one optimizer step here, so with
    gradient accumulation its loss is the step's and `batch_idx` its first micro-batch's."""

    def __init__(
        self,
        mode: str = "min",
        window: int = 10,
        warmup: int = 1,
        atol: float | None = None,
        rtol: float | None = 2.0,
        exclude_batches_path: str | Path | None = None,
        finite_only: bool = True,
    ) -> None:
        self.mode = flags.check_choice("mode", mode, ("min", "max"))
        self.warmup = flags.check_int("warmup", warmup, 0)
        self.atol, self.rtol = atol, rtol
        self.losses = LossWindow(flags.check_int("window", window, 1))
        self.last_val = 0.0
        self.bad_batches: list[int] = []
        self.exclude_batches_path = exclude_batches_path
        self.finite_only = finite_only

    @torch.no_grad()
    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"SpikeDetection needs the step's loss; got {type(loss).__name__} (a training_step that returned "
                "None skips its step); allowed: a step that returns its loss"
            )
        if self.exclude_batches_path is None:
            self.exclude_batches_path = os.path.join(trainer.default_root_dir, "skip_batches.json")
        if not str(self.exclude_batches_path).endswith(".json"):
            self.exclude_batches_path = os.path.join(self.exclude_batches_path, "skip_batches.json")
        value = float(loss.detach())
        # each rank judges its own loss; every rank ends on a spike anywhere
        if trainer.strategy.any_rank(batch_idx >= self.warmup and self._is_spike(value)):
            self._handle_spike(trainer, batch_idx)
        if self.finite_only or trainer.strategy.every_rank(math.isfinite(value)):
            self.losses.add(value)
            self.last_val = value

    def _is_spike(self, loss: float) -> bool:
        if self.finite_only and not math.isfinite(loss):
            return True
        change = loss - self.last_val
        if (change <= 0) if self.mode == "min" else (change >= 0):
            return False
        mean = self.losses.mean()
        apart = abs(loss - mean)
        # NaN (an empty window, a non-finite loss) compares false: no spike
        return (self.atol is None or apart >= abs(self.atol)) and (
            self.rtol is None or apart >= abs(self.rtol * mean)
        )

    def _handle_spike(self, trainer: Trainer, batch_idx: int) -> None:
        # the batch itself may be bad, or the one before may have left the weights so
        self.bad_batches.extend([batch_idx - 1, batch_idx])
        if trainer.is_global_zero:
            path = Path(self.exclude_batches_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.bad_batches, indent=4))
        raise TrainingSpikeException(batch_idx)

    def state_dict(self) -> dict[str, Any]:
        return {
            "last_val": self.last_val,
            "mode": self.mode,
            "warmup": self.warmup,
            "atol": self.atol,
            "rtol": self.rtol,
            "bad_batches": self.bad_batches,
            "bad_batches_path": None if self.exclude_batches_path is None else str(self.exclude_batches_path),
            "losses": self.losses.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_val, self.mode, self.warmup = state["last_val"], state["mode"], state["warmup"]
        self.atol, self.rtol, self.bad_batches = state["atol"], state["rtol"], list(state["bad_batches"])
        self.exclude_batches_path = state["bad_batches_path"]
        self.losses.load_state_dict(state["losses"])
