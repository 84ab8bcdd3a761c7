"""Lightning's `datamodule=`: any object with `setup(stage)` and `*_dataloader()` methods supplies the
loaders of fit, validate, test and predict (each process calls them, as under Lightning). A module
that defines the `*_dataloader()` methods itself is its own source when no loaders are given."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# the loaders each stage reads: (required, optional)
_METHODS = {
    "fit": ("train_dataloader", "val_dataloader"),
    "validate": ("val_dataloader", None),
    "test": ("test_dataloader", None),
    "predict": ("predict_dataloader", None),
}


def has_loader(source: Any, stage: str) -> bool:
    """Whether `source` defines the loader method `stage` needs."""
    return callable(getattr(source, _METHODS[stage][0], None))


def loaders_from(
    datamodule: Any, stage: str, given: Any, call_setup: bool = True
) -> tuple[Iterable, Iterable | None]:
    """`datamodule.setup(stage)` (unless `call_setup` is False: a module, which the Trainer sets up
    itself) then its loaders for `stage`; a one-line error when loaders were also passed directly or the
    datamodule lacks the method the stage needs."""
    if given is not None:
        raise ValueError(f"{stage} got both dataloaders and a datamodule; allowed: one of the two")
    required, optional = _METHODS[stage]
    if not callable(getattr(datamodule, required, None)):
        raise TypeError(
            f"datamodule {type(datamodule).__name__} has no {required}(), which {stage} needs; allowed: an object "
            f"with {required}() (and optionally setup(stage))"
        )
    setup = getattr(datamodule, "setup", None)
    if call_setup and callable(setup):
        setup(stage)
    extra = getattr(datamodule, optional, None) if optional else None
    return getattr(datamodule, required)(), extra() if callable(extra) else None
