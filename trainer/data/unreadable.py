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
    """The error line of `file`'s first line that is not UTF-8 (a text, CSV or JSON file) or, in a JSON file,
    not a JSON object or of another type than the rows before in a field; None when every line is good."""
    suffix = file.suffix.lower()
    if suffix not in (".txt", ".csv", ".json", ".jsonl"):
        return None  # parquet: binary, no lines
    as_json = suffix in (".json", ".jsonl")
    types: dict[str, str] = {}  # each field's JSON type in the first row that has it
    first = True
    try:
        with open(file, "rb") as lines:
            for number, raw in enumerate(lines, start=1):
                line = utf8_line(file, number, raw)
                if not as_json or not line.strip():
                    continue
                if first and line.lstrip().startswith("["):  # one JSON array, not JSON lines
                    return _array_error(file)
                first = False
                problem = _json_row_problem(line, types)
                if problem is not None:
                    return f"{file}:{number}: {problem}"
    except DataError as err:
        return str(err)
    return None


def _json_row_problem(line: str, types: dict[str, str]) -> str | None:
    """What is wrong with one JSON line as a row: not JSON, not an object, a field of another JSON type
    than in the rows before (`types`, updated)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        return f"invalid JSON ({err.msg} at column {err.colno}); {JSON_LINES}"
    if not isinstance(row, dict):
        return f"a JSON {_JSON_TYPES.get(type(row), type(row).__name__)}, not an object; {JSON_LINES}"
    for key, value in row.items():
        kind = _JSON_TYPES.get(type(value))
        if value is None or kind is None:
            continue
        before = types.setdefault(key, kind)
        if kind != before:  # Arrow holds one type per column
            return f"field {key!r} is {what(value)}, not a {before} as in the rows before; allowed: one type per field"
    return None


def _array_error(file: Path) -> str | None:
    try:
        json.loads(text_of(file))
    except json.JSONDecodeError as err:
        return f"{file}:{err.lineno}: invalid JSON ({err.msg} at column {err.colno}); {JSON_LINES}"
    return None


def _reason(err: BaseException) -> str:
    """The innermost cause's first line, with its type."""
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"
