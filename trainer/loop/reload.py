"""Lightning's `reload_dataloaders_every_n_epochs`: a fit's train loader read again from its datamodule (or
module) at the start of every n-th epoch, and its val loader before the first validation n epochs after it
was last read, as Lightning's fit and evaluation loops decide it."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from trainer.loop.epochs import EpochBatches


class LoaderReload:
    """When to call the loader methods again (`every_n` 0: never). `load("train"|"val")` reads one (None:
    that loader is not the source's to read again); the fit's own first read counts as read at the epoch
    where the loop first asks."""

    def __init__(self, every_n: int = 0, load: Callable[[str], Iterable | None] | None = None) -> None:
        self.every_n, self.load = every_n, load
        self.read_at: dict[str, int] = {}  # "train"/"val" -> the epoch that loader was last read in

    def train(self, batches: EpochBatches, epoch: int) -> bool:
        """At `epoch`'s start: `batches` read from a new train loader when one is due (a resumed epoch's
        position carries over); whether it was."""
        fresh = self._fresh("train", epoch)
        if fresh is not None:
            batches.use(fresh)
        return fresh is not None

    def val(self, loader: Iterable, epoch: int) -> Iterable:
        """Before a validation in `epoch`: a new val loader when one is due, else `loader`."""
        fresh = self._fresh("val", epoch)
        return loader if fresh is None else fresh

    def _fresh(self, which: str, epoch: int) -> Iterable | None:
        if not self.every_n:
            return None
        last = self.read_at.setdefault(which, epoch)
        if epoch - last < self.every_n:
            return None
        self.read_at[which] = epoch
        return self.load(which)
