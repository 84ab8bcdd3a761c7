"""Lightning's `datamodule=`: any object with `prepare_data()`, `setup(stage)` and `*_dataloader()`
methods supplies the loaders of fit, validate, test and predict. A module that defines the
`*_dataloader()` methods itself is its own source when no loaders are given.

As under Lightning, every process calls `setup` and the loader methods, and `prepare_data` (download,
tokenise: work that writes files) runs once per node, on local rank 0, before any process reads."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from trainer.module import HyperParameters, init_arguments

# the loaders each stage reads: (required, optional)
_METHODS = {
    "fit": ("train_dataloader", "val_dataloader"),
    "validate": ("val_dataloader", None),
    "test": ("test_dataloader", None),
    "predict": ("predict_dataloader", None),
}


class DataModule:
    """Lightning's LightningDataModule: subclass it and define the loader methods you need (any object
    with them works too; this base adds the no-op hooks)."""

    prepare_data_per_node = True  # False: prepare_data runs on global rank 0 only (shared storage)

    def prepare_data(self) -> None:
        """Once per node before `setup`: download or write files; do not set state here."""

    def setup(self, stage: str) -> None:
        """In every process before its loaders are read ("fit", "validate", "test" or "predict")."""

    def teardown(self, stage: str) -> None:
        """In every process after the stage, also after an exception."""

    def save_hyperparameters(self, *names: str, ignore: str | list[str] | None = None) -> None:
        """Keep the arguments of the calling `__init__` (all, or `names`, minus `ignore`) in `self.hparams`."""
        frame = inspect.currentframe().f_back
        self.hparams.update(init_arguments(frame, type(self).__name__, names, ignore))

    @property
    def hparams(self) -> HyperParameters:
        """What `save_hyperparameters` kept: a dict that also reads as attributes (`dm.hparams.batch_size`)."""
        return self.__dict__.setdefault("_hparams", HyperParameters())


def is_datamodule(value: Any) -> bool:
    """A DataModule, or an object that supplies loaders without being one (no `__iter__`)."""
    if isinstance(value, DataModule):
        return True
    return (
        value is not None and not hasattr(value, "__iter__") and any(has_loader(value, s) for s in _METHODS)
    )


def has_loader(source: Any, stage: str) -> bool:
    """Whether `source` defines the loader method `stage` needs."""
    return callable(getattr(source, _METHODS[stage][0], None))


def check_source(datamodule: Any, stage: str, given: Any) -> None:
    """A one-line error, before any process starts, when loaders were also passed directly or the
    datamodule lacks the method the stage needs."""
    if given is not None:
        raise ValueError(f"{stage} got both dataloaders and a datamodule; allowed: one of the two")
    required = _METHODS[stage][0]
    if not has_loader(datamodule, stage):
        raise TypeError(
            f"datamodule {type(datamodule).__name__} has no {required}(), which {stage} needs; allowed: an object "
            f"with {required}() (and optionally prepare_data() and setup(stage))"
        )


def call_if_defined(source: Any, method: str, *args: Any) -> None:
    """`source.method(*args)` when `source` has it (a datamodule need not subclass DataModule)."""
    fn = getattr(source, method, None)
    if callable(fn):
        fn(*args)


def loaders_from(source: Any, stage: str) -> tuple[Iterable, Iterable | None]:
    """The loaders `source` (a datamodule or the module itself) gives for `stage`."""
    required, optional = _METHODS[stage]
    extra = getattr(source, optional, None) if optional else None
    return getattr(source, required)(), extra() if callable(extra) else None
