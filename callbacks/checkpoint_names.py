"""How ModelCheckpoint names a checkpoint: Lightning's `filename` templates (`"{epoch}-{val_loss:.2f}"` ->
`epoch=3-val_loss=0.12`), with `-v1`, `-v2`... when the name is taken. Here the name is a directory's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

JOIN_CHAR = "-"  # Lightning's CHECKPOINT_JOIN_CHAR
EQUALS_CHAR = "="  # Lightning's CHECKPOINT_EQUALS_CHAR
_FIELD = re.compile(r"(\{.*?)[:\}]")  # "{name" of each "{name}" or "{name:fmt}"


def check_template(filename: str | None) -> str | None:
    """The `filename` template, or a one-line ValueError: it names one directory, not a path."""
    if filename is None:
        return None
    if not isinstance(filename, str) or not filename or "/" in filename or filename.startswith("."):
        raise ValueError(
            f"filename={filename!r} is invalid; allowed: None or a template of one directory name, such as "
            "'{epoch}-{val_loss:.2f}' (no '/', not starting with '.')"
        )
    return filename


def format_name(filename: str, metrics: dict[str, Any], auto_insert_metric_name: bool = True) -> str:
    """`filename` with each `{name}` / `{name:fmt}` filled from `metrics` (0 where absent, as Lightning
    does); `auto_insert_metric_name` writes `name=` before each value. Names may hold dots or slashes
    ("val/loss"); a slash in the result becomes "_" (the name is one directory)."""
    values = dict(metrics)
    for group in sorted(_FIELD.findall(filename), key=len, reverse=True):
        name = group[1:]
        if auto_insert_metric_name:
            filename = filename.replace(group, name + EQUALS_CHAR + "{" + name)
        filename = filename.replace(group, f"{{0[{name}]")  # "{0[val.loss]}": dots and slashes work
        values.setdefault(name, 0)
    return filename.format(values).replace("/", "_")


def free_name(folder: Path, name: str, enable_version_counter: bool = True) -> Path:
    """`folder/name`, or `name-v1`, `name-v2`... while that is taken (nothing is ever written over)."""
    path, version = Path(folder) / name, 1
    while enable_version_counter and (path.exists() or path.is_symlink()):
        path = Path(folder) / f"{name}{JOIN_CHAR}v{version}"
        version += 1
    return path
