"""Whether a fit's losses and model stay finite: the first step whose loss was not, found without a host sync
per step, and the end-of-fit check that no fit ends quietly with a non-finite model."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from callbacks.checkpoint import ModelNotFiniteError
from trainer.core.dtensors import local_part

if TYPE_CHECKING:
    from strategies.base import Strategy

# losses are checked in groups of this many: a list append per step instead of a few tensor ops
FOLD_EVERY = 32


class LossWatch:
    """This rank's step losses, kept on their device and folded into the first non-finite step every
    FOLD_EVERY steps (or when asked)."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.last: torch.Tensor | None = None  # the loss of the last step that returned one
        self._steps: list[int] = []
        self._losses: list[torch.Tensor] = []
        self._first: torch.Tensor | None = None  # the first non-finite step folded so far (inf: none)

    def record(self, loss: torch.Tensor, step: int) -> None:
        """The loss the model as of `step` (0-based: the updates before it) gave."""
        self.last = loss
        self._steps.append(step)
        self._losses.append(loss.detach() if loss.requires_grad else loss)  # (the loop's is detached)
        if len(self._steps) >= FOLD_EVERY:
            self._fold()

    def first_not_finite(self) -> int | None:
        """The first step of this fit whose loss was not finite on any rank, or None (every rank calls)."""
        self._fold()
        mine = torch.tensor(math.inf) if self._first is None else self._first.cpu()
        found = float(self.strategy.reduce(mine, "min", group="world"))
        return None if math.isinf(found) else int(found)

    def check_end(self, module: torch.nn.Module) -> None:
        """ModelNotFiniteError when the model's parameters, or the last step's loss, are not finite on any rank
        (ModelCheckpoint finds it earlier when there is one). Every rank calls."""
        last = self.last
        bad_loss = last is not None and not bool(torch.isfinite(last.detach()).all())
        bad_model = not all(bool(torch.isfinite(local_part(p.detach())).all()) for p in module.parameters())
        strategy = self.strategy
        if not strategy.any_rank(bad_loss or bad_model):
            return
        since = self.first_not_finite()
        what = (
            "non-finite parameters" if strategy.any_rank(bad_model) else "a non-finite loss at its last step"
        )
        # `since` counts the updates before the step (0-based); the line counts steps as checkpoints do
        first = (
            "every loss was finite" if since is None else f"the loss was first non-finite in step {since + 1}"
        )
        raise ModelNotFiniteError(f"the fit ended with {what} ({first}); nothing it trained since is usable")

    def _fold(self) -> None:
        """The recorded losses' first non-finite step, merged into the one found so far, on the device."""
        if not self._losses:
            return
        try:  # one op for losses of one shape (the loop's are 0-d), not a reshape per loss
            losses = torch.stack(self._losses).reshape(-1).float()
        except RuntimeError:  # one-element losses of several shapes (a manual step's may be [1], [1, 1]...)
            losses = torch.stack([loss.reshape(()) for loss in self._losses]).float()
        steps = torch.tensor(self._steps, dtype=torch.float32).to(losses.device, non_blocking=True)
        found = torch.where(torch.isfinite(losses), math.inf, steps).min()
        self._first = found if self._first is None else torch.minimum(self._first, found)
        self._steps, self._losses = [], []
