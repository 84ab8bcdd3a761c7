"""The loggers, with Lightning's constructors and attributes: `from trainer.loggers import CSVLogger,
TensorBoardLogger, WandbLogger`. `JSONLLogger` (`<default_root_dir>/logs/metrics.jsonl`) is always on."""

from trainer.loggers.base import Logger, LoggerRun
from trainer.loggers.csv_logs import CSVLogger
from trainer.loggers.jsonl import JSONLLogger
from trainer.loggers.registry import LOGGERS, build_logger
from trainer.loggers.tensorboard import TensorBoardLogger
from trainer.loggers.wandb import WandbLogger

__all__ = [
    "LOGGERS",
    "CSVLogger",
    "JSONLLogger",
    "Logger",
    "LoggerRun",
    "TensorBoardLogger",
    "WandbLogger",
    "build_logger",
]
