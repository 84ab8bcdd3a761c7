"""Classification labels of Hugging Face data: the column checks, the class names and their ids."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trainer.data.hf_datasets import _splits, load_hf_dataset

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict


def _check_columns(data: Dataset, fields: list[str], mode: str, label_field: str) -> None:
    """Every field named is a column; classification labels are ints (one per word for token labels)."""
    from datasets import ClassLabel, Value

    for field in fields:
        if field not in data.column_names:
            raise ValueError(f"field {field!r} is not in the dataset; available columns: {data.column_names}")
    if mode not in ("seq-classification", "token-classification"):
        return
    feature = _label_feature(data, label_field, mode)
    if not (
        isinstance(feature, ClassLabel)
        or (
            isinstance(feature, Value)
            and ("int" in feature.dtype or feature.dtype in ("string", "large_string"))
        )
    ):
        raise ValueError(
            f"labels {label_field!r} are {data.features[label_field]}; allowed: ints, strings or a ClassLabel"
            f"{' (one list per example)' if mode == 'token-classification' else ''}"
        )


def _label_feature(data: Dataset, label_field: str, mode: str) -> Any:
    """The feature of one label (of one word's, for token classification)."""
    feature = data.features[label_field]
    return getattr(feature, "feature", None) if mode == "token-classification" else feature


def class_names(
    data: str | os.PathLike[str] | Dataset | DatasetDict,
    label_field: str = "label",
    task: str = "seq-classification",
) -> list[str] | None:
    """The class names of classification data, in id order: a ClassLabel's names, else the sorted distinct
    strings of its train split (what `class_encode_column` would make); None for int labels."""
    source = load_hf_dataset(data) if isinstance(data, (str, os.PathLike)) else data
    train, _ = _splits(source, 0, 0)
    _check_columns(train, [label_field], task, label_field)
    return _names(train, label_field, task)


def _names(train: Dataset, label_field: str, mode: str) -> list[str] | None:
    from datasets import ClassLabel

    feature = _label_feature(train, label_field, mode)
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    if "int" in feature.dtype:
        return None
    column = train[label_field]
    values = {v for row in column for v in row} if mode == "token-classification" else set(column)
    return sorted(values)


def _label_ids(
    train: Dataset, label_field: str, mode: str, labels: Sequence[str] | None
) -> tuple[dict[str, int], list[str] | None] | None:
    """How the encoder turns labels into class ids: (name -> id, a ClassLabel's names or None), or None
    when the labels are ids already (ints, or a ClassLabel's own order with no other `labels` asked)."""
    from datasets import ClassLabel

    if mode not in ("seq-classification", "token-classification"):
        return None
    if labels is not None and (isinstance(labels, str) or len(set(labels)) != len(labels) or not labels):
        raise ValueError(f"labels={labels!r} is invalid; allowed: a list of distinct class names")
    feature = _label_feature(train, label_field, mode)
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
        return (
            None if labels is None or list(labels) == names else ({n: i for i, n in enumerate(labels)}, names)
        )
    names = _names(train, label_field, mode)
    if names is None:
        return None
    return {n: i for i, n in enumerate(labels if labels is not None else names)}, None
