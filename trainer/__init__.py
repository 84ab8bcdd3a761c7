"""trainer: the loop and everything a single process needs."""

from typing import Any

from trainer.core.logging import rank_zero_only
from trainer.core.rng import seed_everything
from trainer.datamodule import DataModule
from trainer.module import TrainModule

__all__ = ["DataModule", "TrainModule", "Trainer", "rank_zero_only", "seed_everything"]


def __getattr__(name: str) -> Any:
    # Trainer is imported on first use: strategies import trainer's leaf modules (checkpoint, precision),
    # and an eager import here would make `import strategies` circular.
    if name == "Trainer":
        from trainer.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
