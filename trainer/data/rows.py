"""The rows a fine-tune reads, checked before anything is tokenised: each text field a string, each chat
a non-empty list of {"role", "content"} strings. A malformed row fails in one line naming where it is (the
data file's line for JSON lines, else its index) and the field, or with `skip` is left out and counted.

Most data comes as typed Arrow columns, checked whole (a string column can only hold strings or nulls);
a column datasets stored as JSON values (mixed types) is checked row by row.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

logger = logging.getLogger(__name__)

TEXT, MESSAGES = "text", "messages"  # the kinds of field a row is checked for
ALLOWED = {TEXT: "a string", MESSAGES: 'a non-empty list of {"role": string, "content": string}'}
SKIP_HINT = "skip_bad_rows=True (recipes: data.skip_bad_rows=true) skips such rows"
_SHOWN = 3  # skipped rows named in the count line
_BATCH = 4096  # rows decoded at a time when every row is checked
_ORIGINS: dict[str, Path] = {}  # a dataset's fingerprint -> the data file it was read from


class DataError(ValueError):
    """Data that cannot be trained on: a malformed row, or a file that cannot be read; one line naming it."""


def remember_origin(dataset: Dataset, path: Path) -> Dataset:
    """`dataset`, remembered as read from the data file `path`, so its rows can be named by file:line."""
    _ORIGINS[dataset._fingerprint] = Path(path)
    return dataset


def check_rows(
    data: Dataset | DatasetDict, kinds: Mapping[str, str], skip: bool = False
) -> Dataset | DatasetDict:
    """`data` (each split of a DatasetDict that has all the fields) once every field of `kinds`
    (name -> TEXT or MESSAGES) holds what its kind allows in every row; raises DataError at the first bad
    row, or with `skip` leaves the bad rows out and logs how many of how many."""
    from datasets import DatasetDict

    if isinstance(data, DatasetDict):
        return DatasetDict({name: _checked(split, kinds, skip, name) for name, split in data.items()})
    return _checked(data, kinds, skip, "data")


def _checked(dataset: Dataset, kinds: Mapping[str, str], skip: bool, name: str) -> Dataset:
    if not all(field in dataset.column_names for field in kinds):
        return dataset  # the missing column is refused by name where the split is used
    problems: dict[int, tuple[str, str]] = {}  # row -> (what is wrong, what is allowed)
    for field, kind in kinds.items():
        for row, value in _values(dataset, field, kind):
            problem = _problem(value, kind)
            if problem is not None and row not in problems:
                problems[row] = (f"field {field!r} {problem}", ALLOWED[kind])
    if not problems:
        return dataset
    rows = sorted(problems)
    places = _places(dataset, rows[:_SHOWN], name)  # one pass over the file, for the rows named
    if not skip:
        problem, allowed = problems[rows[0]]
        raise DataError(f"{places[rows[0]]}: {problem}; allowed: {allowed} ({SKIP_HINT})")
    shown = ", ".join(f"{places[row]} {problems[row][0]}" for row in rows[:_SHOWN])
    more = f" and {len(rows) - _SHOWN} more" if len(rows) > _SHOWN else ""
    logger.warning("%d of %d rows skipped: %s%s", len(rows), len(dataset), shown, more)
    bad = set(rows)
    return dataset.select([i for i in range(len(dataset)) if i not in bad])


def _values(dataset: Dataset, field: str, kind: str) -> Iterator[tuple[int, Any]]:
    """(row, value of `field`) of the rows that may be malformed: the few `_suspects` of a typed column,
    else every row, read a batch at a time."""
    column = dataset.select_columns([field])
    suspects = _suspects(dataset, field, kind)
    if suspects is not None:
        yield from ((row, column[row][field]) for row in suspects)
        return
    for start, batch in zip(range(0, len(column), _BATCH), column.iter(batch_size=_BATCH), strict=False):
        yield from enumerate(batch[field], start=start)


def _suspects(dataset: Dataset, field: str, kind: str) -> list[int] | None:
    """Rows whose `field` may be malformed: the nulls (and empty or incomplete chats) of a typed column,
    found by Arrow; None (every row) for a column of mixed JSON values."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets import List, Value

    feature = dataset.features[field]
    column = dataset.with_format("arrow")[field]
    if kind == TEXT and feature in (Value("string"), Value("large_string")):
        return pc.indices_nonzero(pc.is_null(column)).to_pylist()
    parts = getattr(feature, "feature", None) if isinstance(feature, List) else None
    if (
        kind == MESSAGES
        and isinstance(parts, dict)
        and all(parts.get(key) in (Value("string"), Value("large_string")) for key in ("role", "content"))
    ):
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        empty = pc.fill_null(pc.equal(pc.list_value_length(column), 0), True)
        messages = pc.list_flatten(column)
        incomplete = pc.or_(
            pc.is_null(pc.struct_field(messages, "role")), pc.is_null(pc.struct_field(messages, "content"))
        )
        owners = pc.take(
            pc.list_parent_indices(column), pc.indices_nonzero(pc.or_(incomplete, messages.is_null()))
        )
        return sorted(set(pc.indices_nonzero(empty).to_pylist()) | set(owners.to_pylist()))
    return None


def _problem(value: Any, kind: str) -> str | None:
    """What is wrong with one field's `value` (None: nothing)."""
    if value is None:
        return "is missing"
    if kind == TEXT:
        return None if isinstance(value, str) else f"is {what(value)}, not a string"
    if not isinstance(value, list):
        return f"is {what(value)}, not a list of messages"
    if not value:
        return "is an empty list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is {what(message)}, not a {{'role', 'content'}} object"
        for key in ("role", "content"):
            if message.get(key) is None:
                return f"message {i} has no {key!r}"
            if not isinstance(message[key], str):
                return f"message {i}'s {key!r} is {what(message[key])}, not a string"
    return None


def what(value: Any) -> str:
    """A value's type and (shortened) repr, for an error line."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _places(dataset: Dataset, rows: list[int], name: str) -> dict[int, str]:
    """Where each of `rows` is: FILE:LINE in a JSON-lines data file the dataset was read from as is, else
    its index (`name`[i])."""
    origin = _ORIGINS.get(dataset._fingerprint)
    if origin is None or origin.suffix.lower() not in (".json", ".jsonl"):
        return {row: f"{name}[{row}]" for row in rows}
    lines = json_lines(origin, rows)
    return {row: f"{origin}:{lines[row]}" if row in lines else f"{origin} row {row}" for row in rows}


def json_lines(path: str | os.PathLike[str], rows: list[int]) -> dict[int, int]:
    """{row: its line number} in a JSON-lines file, whose row i is its i-th non-blank line (as datasets
    reads it); {} for a JSON array file, whose rows have no lines of their own."""
    wanted, found = set(rows), {}
    with open(path, "rb") as lines:
        row = 0
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if row == 0 and line.lstrip().startswith(b"["):
                return {}
            if row in wanted:
                found[row] = number
                if len(found) == len(wanted):
                    break
            row += 1
    return found
