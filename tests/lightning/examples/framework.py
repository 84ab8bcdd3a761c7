"""The names Lightning's examples import, from PyTorch Lightning or from this project, as the environment
variable EXAMPLES_FRAMEWORK ("lightning" or "trainer") says when this module is first imported (run.py
sets it, one process per framework). A vendored example imports everything it took from `lightning.pytorch`
from here; nothing else in it is changed. Shared by both: the MNIST stand-in and, without torchvision,
`transforms.ToTensor` (standins.py); the harness's own names (`seed_everything`, `CSVLogger`) too."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

from standins import MNIST, ToTensor

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
    from pytorch_lightning.cli import LightningCLI
    from pytorch_lightning.loggers import CSVLogger
    from pytorch_lightning.utilities import rank_zero_only
    from pytorch_lightning.utilities.imports import _TORCHVISION_AVAILABLE
elif FRAMEWORK == "trainer":
    import callbacks
    from trainer import DataModule as LightningDataModule
    from trainer import Trainer, rank_zero_only, seed_everything
    from trainer import TrainModule as LightningModule
    from trainer.loggers import CSVLogger

    _TORCHVISION_AVAILABLE = importlib.util.find_spec("torchvision") is not None

    def cli_lightning_logo() -> None:
        """Lightning's banner, which an example prints when run as a script: this project has none."""
        print("trainer: a Lightning-style training framework for PyTorch")

    def LightningCLI(*args: object, **kwargs: object) -> None:  # noqa: N802 (Lightning's class name)
        """Not built here (the examples' notes say so): an example's `cli_main` is run by constructing its
        module, datamodule and Trainer as LightningCLI would (run.py)."""
        raise NotImplementedError(
            "LightningCLI is not built in this project; construct the module, the datamodule and the Trainer "
            "and call fit/test/predict (tests/lightning/examples/run.py does)"
        )
else:
    raise ValueError(f"EXAMPLES_FRAMEWORK={FRAMEWORK!r} is unknown; allowed: 'lightning', 'trainer'")

if _TORCHVISION_AVAILABLE:
    from torchvision import transforms
else:
    # what an example without torchvision still constructs (MyDataModule's `transforms.ToTensor()`)
    transforms = SimpleNamespace(ToTensor=ToTensor)

__all__ = [
    "MNIST",
    "CSVLogger",
    "LightningCLI",
    "LightningDataModule",
    "LightningModule",
    "Trainer",
    "_TORCHVISION_AVAILABLE",
    "callbacks",
    "cli_lightning_logo",
    "rank_zero_only",
    "seed_everything",
    "transforms",
]
