"""Lightning's TensorBoardLogger: scalars (and the hyperparameters, also as `hparams.yaml`) to
`<save_dir>/<name>/version_N`; needs the `tensorboard` package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from lightning_utilities.core.imports import RequirementCache
from lightning_utilities.core.rank_zero import rank_zero_only

from trainer.loggers.base import LoggerRun, NoExperiment, plain
from trainer.loggers.versions import VersionedLogger

_TENSORBOARD_AVAILABLE = RequirementCache("tensorboard")  # read from package metadata when first asked


class TensorBoardLogger(VersionedLogger):
    """A `SummaryWriter` on `log_dir` (`**kwargs` go to it, as in Lightning); a resumed run continuing its
    folder purges the events after the restored step, so the curves read as one uninterrupted run.
    `default_hp_metric` logs Lightning's placeholder `hp_metric` -1 with the hyperparameters; `prefix` is
    put before every metric name, joined with "-"."""

    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(
        self,
        save_dir: str | Path | None = None,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        **kwargs: Any,
    ) -> None:
        if log_graph:
            raise ValueError(
                "TensorBoardLogger log_graph=True is not supported (the graph is not traced here); allowed: "
                "False, or self.logger.experiment.add_graph(model, example) in a hook of yours"
            )
        if not _TENSORBOARD_AVAILABLE:
            raise ImportError(
                "TensorBoardLogger needs the 'tensorboard' package, which is not installed: "
                "pip install tensorboard (or the project's [tensorboard] extra)"
            )
        super().__init__(save_dir, name, version)
        self.hparams: dict[str, Any] = {}
        self.default_hp_metric, self.prefix, self._kwargs = default_hp_metric, prefix, kwargs
        self._writer = None

    @property
    def experiment(self) -> Any:
        """The `SummaryWriter` (`self.logger.experiment.add_image(...)`); a do-nothing one off rank zero."""
        return self._writer if self._writer is not None else NoExperiment()

    def setup(self, run: LoggerRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder = self.claim(run)
        purge = run.resume_step + 1 if self.continues else None
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=purge, **self._kwargs)

    @rank_zero_only  # as Lightning's: a call on another rank does nothing
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        self.hparams.update(plain(dict(params)))
        with open(Path(self.log_dir) / self.NAME_HPARAMS_FILE, "w") as file:
            yaml.safe_dump(self.hparams, file)
        flat = {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in _flat(self.hparams)}
        metrics = {"hp_metric": -1} if self.default_hp_metric else {}
        if metrics:
            self.log_metrics(metrics, 0)
        writer = self._writer._get_file_writer()
        for summary in hparams(flat, metrics):  # the HPARAMS tab, as Lightning writes it
            writer.add_summary(summary)

    @rank_zero_only  # as Lightning's: a call on another rank does nothing
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(f"{self.prefix}-{name}" if self.prefix else name, value, step)

    def finalize(self, status: str = "success") -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.release()


def _flat(params: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested keys joined with "/" (Lightning's flattening), for the HPARAMS tab."""
    out = []
    for key, value in params.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}/")
        else:
            out.append((f"{prefix}{key}", value))
    return out
