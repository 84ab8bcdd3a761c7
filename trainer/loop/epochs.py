"""The training data epoch by epoch, resumable at any optimizer-step boundary.

Two kinds of loader are resumed exactly:
- a loader with `state_dict()`/`load_state_dict()` (trainer.data.TokenLoader, torchdata's
  StatefulDataLoader) restores its own position, in O(1) for ours;
- any other loader (a plain DataLoader) is replayed: the RNG state from the start of the epoch is
  restored so the shuffle is the same, the consumed batches are read and dropped, then the run's RNG
  comes back. Correct for any map-style dataset; it costs reading those batches once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from trainer.core.rng import rng_state, set_rng_state


class EpochBatches:
    """Iterates `loader` one epoch at a time and knows how to come back to a position."""

    def __init__(
        self, loader: Iterable, limit: int | float | None = None, name: str = "limit_train_batches"
    ) -> None:
        self.limit, self.name = limit, name  # name: the Trainer flag the limit came from, for errors
        self.use(loader)
        self._epoch_rng: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None

    def use(self, loader: Iterable) -> None:
        """Read `loader` from the next `begin` on (a loader read again: reload_dataloaders_every_n_epochs);
        the limit and a position waiting to be restored stay."""
        self.loader = loader
        self.stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        )

    def epoch_length(self) -> int | None:
        """Batches per epoch after `limit` (an int count or a fraction), None when the loader has no len."""
        try:
            full = len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            full = None
        if self.limit is None:
            return full
        if isinstance(self.limit, float):
            if full is None:
                raise ValueError(
                    f"{self.name}={self.limit} is a fraction but the loader has no len(); pass an int"
                )
            return int(full * self.limit)
        return self.limit if full is None else min(full, self.limit)

    def begin(self, epoch: int, consumed: int) -> Iterator:
        """An iterator over `epoch` that starts after `consumed` batches (non-zero only when resuming)."""
        pending, self._pending = self._pending, None
        if self.stateful:
            if pending is not None:
                self.loader.load_state_dict(pending["loader"])
            else:
                _set_epoch(self.loader, epoch)
            return iter(self.loader)
        _set_epoch(self.loader, epoch)
        if pending is None or consumed == 0:
            self._epoch_rng = rng_state()
            return iter(self.loader)
        run_rng = rng_state()
        self._epoch_rng = pending["epoch_rng"]
        set_rng_state(self._epoch_rng)
        iterator = iter(self.loader)
        for _ in range(consumed):
            next(iterator)
        set_rng_state(run_rng)
        return iterator

    def state_dict(self) -> dict[str, Any]:
        if self.stateful:
            return {"loader": self.loader.state_dict()}
        return {"epoch_rng": self._epoch_rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes effect at the next `begin`."""
        self._pending = state


def _set_epoch(loader: Any, epoch: int) -> None:
    """Tell the loader (or its sampler, e.g. DistributedSampler, or its batch sampler, e.g. DP-SGD's Poisson
    one, as Lightning does) which epoch it is, for its shuffle."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for obj in (
        loader,
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
    ):
        if callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)
            return
