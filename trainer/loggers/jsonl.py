"""The always-on log: one JSON object per logged step in `<default_root_dir>/logs/metrics.jsonl`, and the
run's record (flags, shape, the module's hparams) in `hparams.json` beside it."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from trainer.loggers.base import Logger, LoggerRun

# rows reach the file at least this often (and before each checkpoint, `save`), formatted and written
# together: a line encoded and written per row was a third of a logged step's cost on a small model (its
# code cold every tenth step), and a run killed at once loses at most the rows of the last second after
# its last checkpoint, which its resume logs again (Lightning's CSV file waits 100 steps, TensorBoard's
# writer 120 s)
FLUSH_EVERY_S = 1.0


class JSONLLogger(Logger):
    """One JSON object per logged step. A fresh run moves an existing file aside (metrics.<time>.jsonl)
    rather than overwrite it; a resumed run drops the entries after the restored step."""

    _SHARED = ("path",)

    def __init__(self, save_dir: str | Path | None = None) -> None:
        self._save_dir = Path(save_dir) if save_dir is not None else None
        self.path: Path | None = None
        self._file = None
        self._flushed = 0.0  # time.monotonic() of the last flush
        self._rows: list[tuple[int | None, dict[str, float]]] = []  # logged since it

    @property
    def save_dir(self) -> str | None:
        return None if self.path is None else str(self.path.parent)

    @property
    def log_dir(self) -> str | None:
        return self.save_dir

    def setup(self, run: LoggerRun) -> None:
        directory = self._save_dir or Path(run.root_dir) / "logs"
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "metrics.jsonl"
        if self.path.exists():
            if run.resume_step is None:
                self.path.rename(directory / f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            else:
                kept = [
                    line for line in self.path.read_text().splitlines() if _step_of(line) <= run.resume_step
                ]
                self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")
        self._flushed = time.monotonic()

    def log_run(self, run: dict[str, Any]) -> None:
        (self.path.parent / "hparams.json").write_text(json.dumps(run, indent=1, default=str))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self._rows.append((step, dict(metrics)))  # written at the next flush, all at once
        if time.monotonic() - self._flushed >= FLUSH_EVERY_S:
            self.save()

    def save(self) -> None:
        if self._file is not None:
            self._file.write("".join(_line(step, metrics) for step, metrics in self._rows))
            self._file.flush()
            self._rows.clear()
            self._flushed = time.monotonic()

    def finalize(self, status: str = "success") -> None:
        if self._file is not None:
            self.save()
            self._file.close()
            self._file = None


def _line(step: int | None, metrics: dict[str, float]) -> str:
    """A row as one JSON line: a non-finite value as its name ("nan", "inf"), which JSON has no number for."""
    clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
    return json.dumps({"step": step, **clean}) + "\n"


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0
