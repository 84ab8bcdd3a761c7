"""Loggers (JSONL always, TensorBoard, Weights & Biases) and rank-zero console helpers.

Loggers run on rank zero only and open nothing until `setup(run_dir, resume_step)`, so they can be
built in a launcher process and used in a worker. On resume, entries after the restored step are
dropped (JSONL) or purged (TensorBoard), so the metric history reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from lightning_utilities.core.imports import RequirementCache
from lightning_utilities.core.rank_zero import rank_zero_only

log = logging.getLogger("trainer")
_TENSORBOARD_AVAILABLE = RequirementCache("tensorboard")  # read from package metadata when first asked


def set_rank(rank: int) -> None:
    """Tell the rank-zero helpers (lightning-utilities' `rank_zero_only.rank`) and the console which rank
    this process is."""
    rank_zero_only.rank = rank
    _style_console()


@rank_zero_only
def rank_zero_info(message: str) -> None:
    """An info line, from rank zero only."""
    log.info(message)


def configure_console_logging() -> None:
    """Show the framework's info lines on stderr unless the application configured logging itself."""
    if not log.handlers and not logging.getLogger().handlers:
        log.addHandler(logging.StreamHandler(sys.stderr))
        log.propagate = False
    _style_console()


def _style_console() -> None:
    """Rank zero prints info lines; other ranks print only warnings and errors, prefixed with their rank."""
    rank = rank_zero_only.rank
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    prefix = "[trainer]" if rank == 0 else f"[trainer rank {rank}]"
    for handler in log.handlers:
        handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))


set_rank(int(os.environ.get("RANK", 0)))  # until the strategy knows the process group


class Logger:
    """Receives hyperparameters once and metrics per logged step (on rank zero)."""

    def setup(self, run_dir: Path, resume_step: int | None) -> None:
        """Open files under `run_dir`; `resume_step` is the restored step, None for a fresh run."""

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record the run's configuration."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def finalize(self) -> None:
        """Flush and close."""


class JSONLLogger(Logger):
    """One JSON object per logged step in `<run_dir>/logs/metrics.jsonl`; always on.

    A fresh run moves an existing file aside (metrics.<time>.jsonl) rather than overwrite it.
    """

    def __init__(self, save_dir: str | Path | None = None) -> None:
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self.path: Path | None = None
        self._file = None

    def setup(self, run_dir: Path, resume_step: int | None) -> None:
        directory = self.save_dir or Path(run_dir) / "logs"
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "metrics.jsonl"
        if self.path.exists():
            if resume_step is None:
                self.path.rename(directory / f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            else:
                kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= resume_step]
                self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a", buffering=1)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        (self.path.parent / "hparams.json").write_text(json.dumps(params, indent=1, default=str))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")

    def finalize(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


class TensorBoardLogger(Logger):
    """Scalars to `<run_dir>/tensorboard` (needs the `tensorboard` package)."""

    def __init__(self, save_dir: str | Path | None = None) -> None:
        if not _TENSORBOARD_AVAILABLE:
            raise ImportError(
                "TensorBoardLogger needs the 'tensorboard' package, which is not installed: "
                "pip install tensorboard (or the project's [tensorboard] extra)"
            )
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self._writer = None

    def setup(self, run_dir: Path, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        directory = self.save_dir or Path(run_dir) / "tensorboard"
        purge = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(log_dir=str(directory), purge_step=purge)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self._writer.add_text("hparams", json.dumps(params, indent=1, default=str))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbLogger(Logger):
    """Weights & Biases; offline (sync later with `wandb sync`) unless an API key is configured.

    `mode` None chooses: $WANDB_MODE if set, "online" with $WANDB_API_KEY or a wandb netrc entry,
    else "offline". A resumed run continues the same wandb run id.
    """

    def __init__(
        self, project: str = "trainer", name: str | None = None, mode: str | None = None, **init_kwargs: Any
    ):
        self.project, self.name, self.mode, self.init_kwargs = project, name, mode, init_kwargs
        self._run = None

    def setup(self, run_dir: Path, resume_step: int | None) -> None:
        import wandb

        mode = self.mode or os.environ.get("WANDB_MODE") or ("online" if _has_wandb_key() else "offline")
        if mode == "offline" and self.mode is None and "WANDB_MODE" not in os.environ:
            rank_zero_info("wandb: no API key found, logging offline; upload later with `wandb sync`")
        id_file = Path(run_dir) / "logs" / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else None
        self._run = wandb.init(
            project=self.project,
            name=self.name,
            dir=str(run_dir),
            mode=mode,
            id=run_id,
            resume="allow" if run_id else None,
            **self.init_kwargs,
        )
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self._run.id)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def finalize(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text()


LOGGERS: dict[str, type[Logger]] = {
    "jsonl": JSONLLogger,
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
}


def build_logger(spec: str | Logger) -> Logger:
    """A Logger from an instance or a name in LOGGERS."""
    if isinstance(spec, Logger):
        return spec
    if spec not in LOGGERS:
        raise ValueError(f"logger {spec!r} is unknown; allowed: {', '.join(LOGGERS)} or a Logger instance")
    return LOGGERS[spec]()
