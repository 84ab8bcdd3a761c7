"""`version_N` folders, as Lightning numbers its loggers' runs: a base folder and the `version_N` under it.
A run's checkpoint folders (trainer/checkpoint/run_folder.py) and the loggers' (trainer/loggers/versions.py)
are counted the same way, by this one listing."""

from __future__ import annotations

import re
from pathlib import Path

_VERSION = re.compile(r"^version_(\d+)$")


def versions(base: Path) -> list[tuple[int, Path]]:
    """(N, folder) of the base (N = 0) and every `version_N` under it, oldest first."""
    found = [(0, Path(base))]
    if Path(base).is_dir():
        found += sorted(
            (int(m.group(1)), p) for p in Path(base).iterdir() if (m := _VERSION.match(p.name)) and p.is_dir()
        )
    return found
