"""What fit/validate/test/predict are given, checked before any process starts: the module, the loaders
(or what supplies them) and the checkpoint path, each refused with a one-line error."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.datamodule import check_source, has_loader, is_datamodule
from trainer.module import TrainModule


def split_datamodule(loaders: Any, datamodule: Any, stage: str) -> tuple[Any, Any]:
    """Lightning's `fit(model, dm)` / `test(model, dm)`: a DataModule passed where the loaders go is the
    datamodule; (loaders, datamodule) as the stage reads them."""
    if not is_datamodule(loaders):
        return loaders, datamodule
    if datamodule is not None:
        raise ValueError(
            f"{stage} got a datamodule twice (in place of the dataloaders and as datamodule=); allowed: one"
        )
    return None, loaders


def check_fit(
    module: Any, train: Iterable | None, val: Iterable | None, ckpt_path: Any, datamodule: Any
) -> None:
    """`Trainer.fit`'s inputs: loaders given, or a datamodule or the module's own `train_dataloader()`."""
    check_module(module)
    given = train if val is None else val
    if _loader_source(module, "fit", datamodule, given, own=train is None) is None:
        if train is None:
            raise ValueError("fit needs train_dataloaders; got None")
        check_not_empty("train_dataloaders", train)
        if val is not None:
            check_not_empty("val_dataloaders", val)
    _check_ckpt_path(ckpt_path)


def check_evaluate(module: Any, loader: Iterable | None, ckpt_path: Any, stage: str, datamodule: Any) -> None:
    """`validate`/`test`/`predict`'s inputs: a loader given, or a datamodule or the module's own."""
    check_module(module)
    if _loader_source(module, stage, datamodule, loader, own=loader is None) is None:
        if loader is None:
            raise ValueError(f"{stage} needs dataloaders or a datamodule; got neither")
        check_not_empty("dataloaders", loader)
    _check_ckpt_path(ckpt_path, best=True)


def check_module(module: Any) -> None:
    """A TrainModule, else a one-line error naming what was given."""
    if not isinstance(module, TrainModule):
        raise TypeError(f"expected a TrainModule, got {type(module).__name__}")


def check_not_empty(name: str, loader: Any) -> None:
    """A loader that says it has no batches is refused before anything starts (it would end the run later)."""
    try:
        length = len(loader)
    except TypeError:  # an iterable without len(): known only once read
        return
    if length == 0:
        raise ValueError(
            f"{name} is empty (len 0); allowed: a loader that yields at least one batch, or None"
        )


def _loader_source(module: TrainModule, stage: str, datamodule: Any, given: Any, own: bool) -> Any:
    """What supplies `stage`'s loaders inside each process: the datamodule (checked now, before any
    process starts), the module's own `*_dataloader()` when none were `given`, or None (passed loaders)."""
    if datamodule is not None:
        check_source(datamodule, stage, given)
        return datamodule
    return module if own and has_loader(module, stage) else None


def _check_ckpt_path(ckpt_path: Any, best: bool = False) -> None:
    """An existing checkpoint directory, "last" or None (and for validate/test/predict "best": the best
    checkpoint of this Trainer's fit, by its ModelCheckpoint's monitor)."""
    names = ("last", "best") if best else ("last",)
    if ckpt_path is not None and ckpt_path not in names and not Path(ckpt_path).exists():
        allowed = (
            "an existing checkpoint directory, 'last', 'best' or None"
            if best
            else ("an existing checkpoint directory, 'last' or None")
        )
        if ckpt_path == "best":
            allowed += " ('best' is for validate, test and predict)"
        raise FileNotFoundError(f"ckpt_path '{ckpt_path}' does not exist; allowed: {allowed}")
