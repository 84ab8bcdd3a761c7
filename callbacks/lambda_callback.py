"""LambdaCallback: a callback made on the spot from functions, one per hook (Lightning's)."""

from __future__ import annotations

from collections.abc import Callable

from callbacks.base import Callback

# what is not a hook among Callback's public names
_NOT_HOOKS = {"state_key", "state_dict", "load_state_dict"}
HOOKS = tuple(name for name in vars(Callback) if not name.startswith("_") and name not in _NOT_HOOKS)


class LambdaCallback(Callback):
    """Each keyword names a hook and gives the function it runs, called with the hook's arguments
    (`LambdaCallback(on_fit_start=lambda trainer, module: ...)`); None leaves the hook as it is. Every hook of
    `Callback` may be given."""

    def __init__(self, **hooks: Callable | None) -> None:
        for name, fn in hooks.items():
            if name not in HOOKS:
                raise TypeError(
                    f"LambdaCallback got {name}=, which is no callback hook; allowed: {', '.join(HOOKS)}"
                )
            if fn is not None:
                # an instance attribute: called unbound, with the hook's own arguments (as Lightning's)
                setattr(self, name, fn)
