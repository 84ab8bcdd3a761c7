"""trainer: the loop and everything a single process needs."""

from trainer.module import TrainModule
from trainer.rng import seed_everything
from trainer.trainer import Trainer

__all__ = ["TrainModule", "Trainer", "seed_everything"]
