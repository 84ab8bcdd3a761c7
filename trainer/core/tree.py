"""Apply a function to every tensor in a nested batch (dicts, lists, tuples, namedtuples, dataclasses)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection


def apply_to_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of `obj` with `fn` applied to each tensor; other leaves are kept as they are."""
    return apply_to_collection(obj, torch.Tensor, fn)
