"""Lightning's CSVLogger: `metrics.csv` (a `step` column and one column per metric, sorted, a row per logged
step: what `pandas.read_csv` of a Lightning run reads) and `hparams.yaml` in `<save_dir>/<name>/version_N`."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import yaml
from lightning_utilities.core.rank_zero import rank_zero_only

from trainer.loggers.base import LoggerRun, NoExperiment, plain
from trainer.loggers.versions import VersionedLogger


class CSVLogger(VersionedLogger):
    """What the module logs (and `epoch`) to `<log_dir>/metrics.csv`, hyperparameters to `<log_dir>/hparams.yaml`. Each row is written
    when logged (a metric seen for the first time rewrites the file with the wider header, as Lightning);
    a resumed run continuing its folder drops the rows after the restored step. `prefix` is put before
    every metric name, joined with "-" (Lightning's)."""

    NAME_METRICS_FILE = "metrics.csv"
    trainer_metrics = False  # what the module logs, as Lightning's file (set True for train/loss, rates...)
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(
        self,
        save_dir: str | Path | None = None,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(save_dir, name, version)
        self.prefix = prefix
        self.hparams: dict[str, Any] = {}
        self._keys: list[str] = []
        self._path: Path | None = None
        self._rows = 0  # rows in the file: the step of a row logged without one, as Lightning numbers it

    @property
    def experiment(self) -> Any:
        """Lightning's experiment writer: the logger itself here (`log_metrics`, `log_hyperparams`); a
        do-nothing one off rank zero."""
        return self if self._path is not None else NoExperiment()

    def setup(self, run: LoggerRun) -> None:
        folder = self.claim(run)
        self._path = folder / self.NAME_METRICS_FILE
        self._keys, self._rows = [], 0
        if self.continues and self._path.exists():
            with open(self._path, newline="") as file:
                reader = csv.DictReader(file)
                kept = [row for row in reader if _step(row) <= run.resume_step]
                self._keys = list(reader.fieldnames or [])
            self._write(kept, "w")
            self._rows = len(kept)

    @rank_zero_only  # as Lightning's: a call on another rank does nothing
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(plain(dict(params)))
        with open(Path(self.log_dir) / self.NAME_HPARAMS_FILE, "w") as file:
            yaml.safe_dump(self.hparams, file)

    @rank_zero_only  # as Lightning's: a call on another rank does nothing
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row = {(f"{self.prefix}-{k}" if self.prefix else k): v for k, v in metrics.items()}
        row["step"] = step if step is not None else self._rows
        self._rows += 1
        if set(row) - set(self._keys):  # a new column: the rows so far get the wider header
            rows = []
            if self._path.exists():
                with open(self._path, newline="") as file:
                    rows = list(csv.DictReader(file))
            self._keys = sorted(set(self._keys) | set(row))
            self._write(rows + [row], "w")
        else:
            self._write([row], "a")

    def finalize(self, status: str = "success") -> None:
        self.release()

    def _write(self, rows: list[dict[str, Any]], mode: str) -> None:
        with open(self._path, mode, newline="") as file:
            writer = csv.DictWriter(file, fieldnames=self._keys)
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)


def _step(row: dict[str, str]) -> float:
    try:
        return float(row.get("step") or 0)
    except ValueError:
        return 0.0
