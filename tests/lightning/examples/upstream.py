"""Lightning's examples that are not copied into this repository: read from a checkout of Lightning's
repository (LIGHTNING_EXAMPLES=<checkout>/examples/pytorch; written against commit 7f0c3436cd) and run with
their import lines replaced by the shim's (framework.py), nothing else changed. Each replacement keeps the
line count, so a traceback's line numbers are the upstream file's; an import line missing upstream fails
the load, naming it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

ENV = "LIGHTNING_EXAMPLES"

# example -> (its path under examples/pytorch, {its import line: the line that replaces it})
IMPORTS: dict[str, tuple[str, dict[str, str]]] = {
    "autoencoder": (
        "basics/autoencoder.py",
        {
            "from lightning.pytorch import LightningDataModule, LightningModule, Trainer, callbacks, cli_lightning_logo": (
                "from framework import LightningDataModule, LightningModule, Trainer, callbacks, cli_lightning_logo"
            ),
            "from lightning.pytorch.cli import LightningCLI": "from framework import LightningCLI",
            "from lightning.pytorch.demos.mnist_datamodule import MNIST": "from framework import MNIST",
            "from lightning.pytorch.utilities import rank_zero_only": "from framework import rank_zero_only",
            # the shim's transforms (ToTensor), which MyDataModule calls even without torchvision
            "from lightning.pytorch.utilities.imports import _TORCHVISION_AVAILABLE": (
                "from framework import _TORCHVISION_AVAILABLE, transforms"
            ),
        },
    ),
    "backbone_image_classifier": (
        "basics/backbone_image_classifier.py",
        {
            "from lightning.pytorch import LightningDataModule, LightningModule, cli_lightning_logo": (
                "from framework import LightningDataModule, LightningModule, cli_lightning_logo"
            ),
            "from lightning.pytorch.cli import LightningCLI": "from framework import LightningCLI",
            "from lightning.pytorch.demos.mnist_datamodule import MNIST": "from framework import MNIST",
            "from lightning.pytorch.utilities.imports import _TORCHVISION_AVAILABLE": (
                "from framework import _TORCHVISION_AVAILABLE, transforms"
            ),
        },
    ),
    "generative_adversarial_net": (
        "domain_templates/generative_adversarial_net.py",
        {
            "from lightning.pytorch import cli_lightning_logo": "from framework import cli_lightning_logo",
            "from lightning.pytorch.core import LightningModule": "from framework import LightningModule",
            "from lightning.pytorch.demos.mnist_datamodule import MNISTDataModule": (
                "from framework import MNISTDataModule"
            ),
            "from lightning.pytorch.trainer import Trainer": "from framework import Trainer",
            # the shim's torchvision (make_grid), which the example's own `import torchvision` replaces
            # where torchvision is installed
            "from lightning.pytorch.utilities.imports import _TORCHVISION_AVAILABLE": (
                "from framework import _TORCHVISION_AVAILABLE, torchvision"
            ),
        },
    ),
    "computer_vision_fine_tuning": (
        "domain_templates/computer_vision_fine_tuning.py",
        {
            "from torchvision import transforms": "from framework import transforms",
            "from torchvision.datasets import ImageFolder": "from framework import ImageFolder",
            "from torchvision.datasets.utils import download_and_extract_archive": (
                "from framework import download_and_extract_archive"
            ),
            "from lightning.pytorch import LightningDataModule, LightningModule, cli_lightning_logo": (
                "from framework import LightningDataModule, LightningModule, cli_lightning_logo"
            ),
            "from lightning.pytorch.callbacks.finetuning import BaseFinetuning": "from framework import BaseFinetuning",
            "from lightning.pytorch.cli import LightningCLI": "from framework import LightningCLI",
            "from lightning.pytorch.utilities import rank_zero_info": "from framework import rank_zero_info",
            "from lightning.pytorch.utilities.model_helpers import get_torchvision_model": (
                "from framework import get_torchvision_model"
            ),
        },
    ),
}


def load(name: str) -> ModuleType:
    """Example `name` as module `name`, its import lines replaced as IMPORTS says."""
    relative, replacements = IMPORTS[name]
    folder = os.environ.get(ENV)
    if not folder:
        raise RuntimeError(f"{ENV} is unset; allowed: the examples/pytorch folder of a Lightning checkout")
    path = Path(folder) / relative
    lines = path.read_text().splitlines(keepends=True)
    for old, new in replacements.items():
        found = [i for i, line in enumerate(lines) if line.rstrip("\n") == old]
        if len(found) != 1:
            raise ValueError(f"{path}: expected the import line {old!r} once, found it {len(found)} times")
        lines[found[0]] = new + "\n"
    module = ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    exec(compile("".join(lines), str(path), "exec"), module.__dict__)  # noqa: S102 (the example's code)
    return module
