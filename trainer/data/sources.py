"""Where documents come from: text files, JSONL, a `datasets` save_to_disk directory, or the embedded corpus."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Iterator
from pathlib import Path

from trainer.data.unreadable import text_of, utf8_line

TEXT_SUFFIXES = (".txt", ".md")
ACCEPTED = (
    "a .txt/.md file, a directory of .txt/.md files, a .jsonl file, or a datasets save_to_disk directory"
)


def read_documents(path: str | os.PathLike[str], text_field: str = "text") -> Iterator[str]:
    """Documents under `path`: a .txt/.md file is one, a directory holds one per file (sorted), a .jsonl
    file one per line (its `text_field`), a `datasets` save_to_disk directory one per row."""
    source = _existing(path)
    # Path errors are raised here, at the call; reading happens lazily as the iterator is consumed.
    if source.is_dir() and _is_saved_dataset(source):
        return _dataset_rows(source, text_field)
    if source.is_dir():
        return (text_of(file) for file in _text_files(source))
    if source.suffix == ".jsonl":
        return _jsonl_rows(source, text_field)
    if source.suffix in TEXT_SUFFIXES:
        return iter([text_of(source)])
    raise ValueError(f"{source}: unsupported file type {source.suffix!r}; allowed: {ACCEPTED}")


def default_corpus() -> list[str]:
    """The English help text that ships inside CPython (`pydoc_data.topics`), one document per topic in
    sorted order: a few hundred kB that every install has, so a run needs no data download."""
    try:
        from pydoc_data.topics import topics
    except ImportError as err:
        raise RuntimeError(
            "the default corpus needs CPython's pydoc_data, which this Python build lacks; pass a corpus path"
        ) from err
    return [topics[key] for key in sorted(topics)]


def source_fingerprint(path: str | os.PathLike[str] | None, text_field: str = "text") -> str:
    """A string that changes whenever the documents could: file names, sizes and mtimes, or for the default
    corpus (path None) the Python version and a hash of its text."""
    if path is None:
        digest = hashlib.sha256()
        for document in default_corpus():
            digest.update(document.encode("utf-8") + b"\0")
        return json.dumps({"default_corpus": platform.python_version(), "sha256": digest.hexdigest()})
    source = _existing(path).resolve()
    files = _visible_files(source) if source.is_dir() else [source]
    stats = [[str(f.relative_to(source)) if source.is_dir() else f.name, *_size_mtime(f)] for f in files]
    return json.dumps({"path": str(source), "text_field": text_field, "files": stats})


def _size_mtime(file: Path) -> tuple[int, int]:
    stat = file.stat()
    return stat.st_size, stat.st_mtime_ns


def _existing(path: str | os.PathLike[str]) -> Path:
    source = Path(path).expanduser()
    if not source.exists():
        raise FileNotFoundError(f"corpus path {str(path)!r} does not exist; allowed: {ACCEPTED}")
    return source


def _is_saved_dataset(directory: Path) -> bool:
    """What `Dataset.save_to_disk` / `DatasetDict.save_to_disk` leave behind."""
    return (directory / "state.json").is_file() or (directory / "dataset_dict.json").is_file()


def _visible_files(directory: Path) -> list[Path]:
    """Files under `directory`, sorted; hidden ones (.git, .ipynb_checkpoints) hold metadata, not corpus."""
    return sorted(
        f
        for f in directory.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(directory).parts)
    )


def _text_files(directory: Path) -> list[Path]:
    files = [f for f in _visible_files(directory) if f.suffix in TEXT_SUFFIXES]
    if not files:
        raise ValueError(f"{directory}: no .txt or .md files in this directory; allowed: {ACCEPTED}")
    return files


def _jsonl_rows(file: Path, text_field: str) -> Iterator[str]:
    with file.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            line = utf8_line(file, number, raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}:{number}: invalid JSON ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise ValueError(
                    f"{file}:{number}: no string field {text_field!r}; allowed: one JSON object per line "
                    f"with a string {text_field!r} (or choose the field with text_field=)"
                )
            yield row[text_field]


def _dataset_rows(directory: Path, text_field: str) -> Iterator[str]:
    import datasets  # ~1 s to import, so only paid when a saved dataset is actually read

    dataset = datasets.load_from_disk(str(directory))
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(
            f"{directory}: a DatasetDict with splits {sorted(dataset)}; allowed: one split's directory, "
            f"e.g. {directory / sorted(dataset)[0]}"
        )
    if text_field not in dataset.column_names:
        raise ValueError(
            f"{directory}: no column {text_field!r}; allowed: one of {dataset.column_names} via text_field="
        )
    for batch in dataset.select_columns([text_field]).iter(batch_size=1024):
        yield from batch[text_field]
