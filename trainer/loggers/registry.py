"""Loggers by name (recipes' `loggers: [jsonl, csv, tensorboard]`), and building one from a name or an
instance."""

from __future__ import annotations

from trainer.loggers.base import Logger
from trainer.loggers.csv_logs import CSVLogger
from trainer.loggers.jsonl import JSONLLogger
from trainer.loggers.tensorboard import TensorBoardLogger
from trainer.loggers.wandb import WandbLogger

LOGGERS: dict[str, type[Logger]] = {
    "jsonl": JSONLLogger,
    "csv": CSVLogger,
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
