"""A class decorator the parity scripts share: each named hook records its name, then does what it did."""

from __future__ import annotations

from collections.abc import Callable


def recording(hooks: list[str], prefix: str, calls: list[str]) -> Callable[[type], type]:
    """Each hook in `hooks` appends `prefix` + its name to `calls`, then runs as before."""

    def wrap(cls: type) -> type:
        for name in hooks:
            original = getattr(cls, name)

            def hook(self, *args, _name=name, _original=original, **kwargs):
                calls.append(prefix + _name)
                return _original(self, *args, **kwargs)

            setattr(cls, name, hook)
        return cls

    return wrap
