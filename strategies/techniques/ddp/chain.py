"""A DDP comm hook another part of the run may wrap later: DDP's reducer takes one hook, once, when the model
is wrapped, while what must run around it (per-step fault tolerance's sum over the replica groups) exists
only once the fit has started."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# what runs in place of the hook: (the hook, DDP's state, the bucket) -> the bucket's future
Around = Callable[[Callable[[Any, Any], torch.futures.Future], Any, Any], torch.futures.Future]


class ChainableHook:
    """`hook` as DDP calls it (with its name and signature, which DDP checks and logs), or, while `around` is
    set, `around(hook, state, bucket)`."""

    def __init__(self, hook: Callable[[Any, Any], torch.futures.Future]) -> None:
        functools.update_wrapper(self, hook)
        self.hook = hook
        self.around: Around | None = None

    def __call__(self, state, bucket):  # noqa: ANN001, ANN204  DDP rejects `__future__`'s string annotations
        """The bucket's future: `hook`'s own, or what `around` makes of it."""
        return self.hook(state, bucket) if self.around is None else self.around(self.hook, state, bucket)
