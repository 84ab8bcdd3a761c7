"""What the tuner's callbacks (LearningRateFinder, BatchSizeFinder) share: the attribute they read and set on
the module, its hparams or the datamodule (Lightning's `lightning_getattr`/`lightning_setattr`), and the exit
that ends a `Tuner`'s fit once they are done."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.module import TrainModule


class TunerExit(Exception):
    """Raised by a tuner callback that a `Tuner` started, once it found its value: the fit ends there (its
    teardown runs, no step is trained) and the Tuner returns the value (Lightning's `_TunerExitException`)."""


def attribute_holders(module: TrainModule, datamodule: Any, name: str) -> list[Any]:
    """Where `name` lives, in Lightning's order: the module, its hparams, the datamodule, its hparams."""
    holders: list[Any] = []
    for owner in (module, datamodule):
        if owner is None:
            continue
        if hasattr(owner, name):
            holders.append(owner)
        if name in getattr(owner, "hparams", {}):
            holders.append(owner.hparams)
    return holders


def get_attribute(module: TrainModule, datamodule: Any, name: str) -> Any:
    """The value of `name` from its last holder (Lightning reads the last one)."""
    holder = _holders(module, datamodule, name)[-1]
    return holder[name] if isinstance(holder, dict) else getattr(holder, name)


def set_attribute(module: TrainModule, datamodule: Any, name: str, value: Any) -> None:
    """`name` = `value` in every holder (module, hparams, datamodule), as Lightning sets it."""
    for holder in _holders(module, datamodule, name):
        if isinstance(holder, dict):
            holder[name] = value
        else:
            setattr(holder, name, value)


def _holders(module: TrainModule, datamodule: Any, name: str) -> list[Any]:
    holders = attribute_holders(module, datamodule, name)
    if not holders:
        raise AttributeError(
            f"{name} is neither an attribute of {type(module).__name__}, nor in its hparams, nor in the datamodule"
        )
    return holders
