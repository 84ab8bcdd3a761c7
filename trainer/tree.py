"""Apply a function to every tensor in a nested batch (dicts, lists, tuples, namedtuples)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def apply_to_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of `obj` with `fn` applied to each tensor; other leaves are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, apply_to_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(apply_to_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(apply_to_tensors(v, fn) for v in obj)
    return obj
