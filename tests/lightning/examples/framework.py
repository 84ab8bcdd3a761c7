"""The names Lightning's examples import, from PyTorch Lightning or from this project, as the environment
variable EXAMPLES_FRAMEWORK ("lightning" or "trainer") says when this module is first imported (run.py
sets it, one process per framework). An example imports everything it took from `lightning.pytorch`
from here; nothing else in it is changed. Shared by both: the stand-ins for what the examples download or
take from torchvision (standins.py, mnist_datamodule.py, cats_and_dogs.py; real torchvision's `transforms`
and `torchvision` where it is installed) and the harness's own names (`seed_everything`, the loggers)."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

from cats_and_dogs import ImageFolder, download_and_extract_archive, get_torchvision_model
from mnist_datamodule import MNISTDataMethods
from standins import MNIST, Compose, Normalize, RandomHorizontalFlip, Resize, ToTensor, make_grid

FRAMEWORK = os.environ["EXAMPLES_FRAMEWORK"]

if FRAMEWORK == "lightning":
    from pytorch_lightning import (
        LightningDataModule,
        LightningModule,
        Trainer,
        callbacks,
        cli_lightning_logo,
        seed_everything,
    )
    from pytorch_lightning.callbacks.finetuning import BaseFinetuning
    from pytorch_lightning.cli import LightningCLI
    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
    from pytorch_lightning.utilities import rank_zero_info, rank_zero_only
    from pytorch_lightning.utilities.imports import _TORCHVISION_AVAILABLE
elif FRAMEWORK == "trainer":
    import callbacks
    from callbacks import BaseFinetuning
    from trainer import DataModule as LightningDataModule
    from trainer import Trainer, rank_zero_only, seed_everything
    from trainer import TrainModule as LightningModule
    from trainer.core.logging import rank_zero_info
    from trainer.loggers import CSVLogger, TensorBoardLogger

    _TORCHVISION_AVAILABLE = importlib.util.find_spec("torchvision") is not None

    def cli_lightning_logo() -> None:
        """Lightning's banner, which an example prints when run as a script: this project has none."""
        print("trainer: a Lightning-style training framework for PyTorch")

    class LightningCLI:
        """Not built here (the examples' notes say so): an example's `cli_main` is run by constructing its
        module, datamodule and Trainer as LightningCLI would (run.py). A class, as examples subclass it."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            raise NotImplementedError(
                "LightningCLI is not built in this project; construct the module, the datamodule and the "
                "Trainer and call fit/test/predict (tests/lightning/examples/run.py does)"
            )
else:
    raise ValueError(f"EXAMPLES_FRAMEWORK={FRAMEWORK!r} is unknown; allowed: 'lightning', 'trainer'")


class MNISTDataModule(MNISTDataMethods, LightningDataModule):
    """Lightning's demo MNISTDataModule (mnist_datamodule.py) on this framework's LightningDataModule."""


if _TORCHVISION_AVAILABLE:
    import torchvision
    from torchvision import transforms
else:
    # what the examples call of torchvision's, which they still call without it
    transforms = SimpleNamespace(
        ToTensor=ToTensor,
        Compose=Compose,
        Resize=Resize,
        RandomHorizontalFlip=RandomHorizontalFlip,
        Normalize=Normalize,
    )
    torchvision = SimpleNamespace(utils=SimpleNamespace(make_grid=make_grid))

__all__ = [
    "MNIST",
    "BaseFinetuning",
    "CSVLogger",
    "ImageFolder",
    "LightningCLI",
    "LightningDataModule",
    "LightningModule",
    "MNISTDataModule",
    "TensorBoardLogger",
    "Trainer",
    "_TORCHVISION_AVAILABLE",
    "callbacks",
    "cli_lightning_logo",
    "download_and_extract_archive",
    "get_torchvision_model",
    "rank_zero_info",
    "rank_zero_only",
    "seed_everything",
    "torchvision",
    "transforms",
]
