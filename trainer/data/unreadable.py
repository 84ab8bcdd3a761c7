"""Where a data file stops being readable, in one line naming FILE:LINE: bytes that are not UTF-8, a line
that is not JSON. datasets' own errors name neither the file nor the line (a decode error of "the
dataset", a JSON error "at position 44"), so a file it cannot read is read again here, line by line, to
find the place; that costs nothing unless reading failed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.data.rows import DataError, what

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

UTF8 = "allowed: UTF-8 text"
_JSON_TYPES = {str: "string", int: "number", float: "number", bool: "boolean", list: "list", dict: "object"}
JSON_LINES = "allowed: one JSON object per line (or one JSON array of objects)"


def utf8_line(file: Path, number: int, raw: bytes) -> str:
    """Line `number` of `file` decoded; a DataError naming the line and byte when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_utf8(file, number, err.start, raw[err.start]) from None


def text_of(file: Path) -> str:
    """The whole of a UTF-8 text file; a DataError naming the line and byte where it is not UTF-8."""
    raw = file.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = raw.rfind(b"\n", 0, err.start) + 1
        number = raw.count(b"\n", 0, err.start) + 1
        raise _not_utf8(file, number, err.start - line_start, raw[err.start]) from None


def _not_utf8(file: Path, number: int, column: int, byte: int) -> DataError:
    return DataError(
        f"{file}:{number}: not UTF-8 text (byte {column + 1} of the line is {byte:#04x}); {UTF8}"
    )


def read_data(
    location: Path, files: Sequence[Path], builder: str | None, **options: Any
) -> Dataset | DatasetDict:
    """datasets.load_dataset of `location` (one data file read by `builder`, or a folder of `files`, None); what
    it cannot read becomes one line naming the file and line where that can be found."""
    import datasets

    try:
        return datasets.load_dataset(builder or str(location), **options)
    except Exception as err:  # datasets wraps the reader's error (Arrow, JSON, a decode) in its own
        raise unreadable(location, files, err) from None


def unreadable(location: Path, files: Sequence[Path], err: BaseException) -> DataError:
    """The DataError of data at `location` (the file, or the folder of `files`) that datasets could not
    read with `err`: the first bad line of a text or JSON file, else datasets' reason."""
    for file in files:
        where = _first_bad_line(file)
        if where is not None:
            return DataError(where)
    return DataError(f"{location}: datasets cannot read it: {_reason(err)}")


def _first_bad_line(file: Path) -> str | None:
    suffix = file.suffix.lower()
    if suffix not in (".txt", ".csv", ".json", ".jsonl"):
        return None  # parquet: binary, no lines
    try:
        with open(file, "rb") as lines:
            decoded = [utf8_line(file, n, raw) for n, raw in enumerate(lines, start=1)]
    except DataError as err:
        return str(err)
    if suffix not in (".json", ".jsonl"):
        return None
    blank = [not line.strip() for line in decoded]
    if False in blank and decoded[blank.index(False)].lstrip().startswith("["):  # one JSON array
        try:
            json.loads("".join(decoded))
        except json.JSONDecodeError as err:
            return f"{file}:{err.lineno}: invalid JSON ({err.msg} at column {err.colno}); {JSON_LINES}"
        return None
    first: dict[str, type] = {}  # each field's type in the first row that has it
    for number, line in enumerate(decoded, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return f"{file}:{number}: invalid JSON ({err.msg} at column {err.colno}); {JSON_LINES}"
        if not isinstance(row, dict):
            return f"{file}:{number}: a JSON {type(row).__name__}, not an object; {JSON_LINES}"
        for key, value in row.items():
            if value is None:
                continue
            seen = first.setdefault(key, type(value))
            if not isinstance(value, seen):  # Arrow wants one type per column
                return (
                    f"{file}:{number}: field {key!r} is {what(value)}, not a {_JSON_TYPES.get(seen, seen.__name__)} "
                    "as in the rows before; allowed: one type per field"
                )
    return None


def _reason(err: BaseException) -> str:
    """The innermost cause's first line, with its type."""
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"
