"""The one place hooks are called: the callbacks' hook first, then the module's (Lightning's order)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from callbacks.checkpoint import ModelCheckpoint
from callbacks.early_stopping import EarlyStopping
from trainer.module import TrainModule

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class HookDispatcher:
    """Calls a trainer's hooks on its callbacks and module; for the hooks that run every step it remembers
    who implements them, so a step pays nothing for the hooks nobody uses."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        # who implements each per-step hook, for `_owners_module` and `_owners_callbacks` (a copy of the list)
        self._owners_module: Any = None
        self._owners_callbacks: list[Callback] = []
        self._owners: dict[str, tuple[list[Callback], bool]] = {}

    def callbacks(self, hook: str, *args: Any) -> None:
        """Every callback's `hook(trainer, module, *args)`."""
        trainer = self.trainer
        for cb in trainer.callbacks:
            getattr(cb, hook)(trainer, trainer.module, *args)

    def all(self, hook: str, *args: Any) -> None:
        """The callbacks' `hook`, then the module's."""
        self.callbacks(hook, *args)
        getattr(self.trainer.module, hook)(*args)

    def train_epoch_end(self, compute_metrics: Callable[[], None]) -> None:
        """Lightning's order at a training epoch's end: the other callbacks, the module, then, once the epoch's
        aggregates are in `callback_metrics` (`compute_metrics`), the monitoring callbacks (EarlyStopping,
        ModelCheckpoint), so that they read what the epoch and its hooks logged."""
        trainer = self.trainer
        monitors = [cb for cb in trainer.callbacks if isinstance(cb, (EarlyStopping, ModelCheckpoint))]
        for cb in trainer.callbacks:
            if cb not in monitors:
                cb.on_train_epoch_end(trainer, trainer.module)
        trainer.module.on_train_epoch_end()
        compute_metrics()
        for cb in monitors:
            cb.on_train_epoch_end(trainer, trainer.module)

    def begin_step(self) -> None:
        """Before a step's first hook: the owners found so far still hold unless the module or the list of
        callbacks changed (checked once a step, not at each of its hooks)."""
        trainer = self.trainer
        if trainer.module is not self._owners_module or trainer.callbacks != self._owners_callbacks:
            self._owners_module, self._owners_callbacks, self._owners = (
                trainer.module,
                list(trainer.callbacks),
                {},
            )

    def step(self, hook: str, args: tuple = ()) -> None:
        """A hook that runs every step, in `all`'s order; the callbacks and module that leave it as the base
        class's no-op are skipped (who implements it is found once per module and callbacks: `begin_step`)."""
        owners = self._owners.get(hook)
        if owners is None:
            self.begin_step()
            owners = self._owners[hook] = self._find_owners(hook)
        if owners is NOBODY:  # (most per-step hooks of most runs)
            return
        callbacks, module_too = owners
        trainer = self.trainer
        for cb in callbacks:
            getattr(cb, hook)(trainer, trainer.module, *args)
        if module_too:
            getattr(trainer.module, hook)(*args)

    def _find_owners(self, hook: str) -> tuple[list[Callback], bool]:
        """The callbacks that implement `hook`, and whether the module does (`NOBODY`: none of them)."""
        trainer = self.trainer
        callbacks = [cb for cb in trainer.callbacks if _implements(cb, hook, Callback)]
        module_too = _implements(trainer.module, hook, TrainModule)
        return (callbacks, module_too) if callbacks or module_too else NOBODY


NOBODY: tuple[list[Callback], bool] = ([], False)


def _implements(obj: Any, hook: str, base: type) -> bool:
    """Whether `obj`'s `hook` may do something: its class overrides `base`'s no-op, or the instance has
    its own (a function set on it)."""
    return getattr(type(obj), hook, None) is not getattr(base, hook) or hook in getattr(obj, "__dict__", ())
