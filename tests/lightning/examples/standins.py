"""What the examples download or take from torchvision, generated here (the tests run offline, without
torchvision): MNIST on generated pixels, and torchvision's `transforms.ToTensor`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

# MNIST's sizes: 60000 training and 10000 test images of 28x28 uint8 pixels, labels 0..9
SIZES = {True: 60000, False: 10000}


class MNIST(Dataset):
    """torchvision's `datasets.MNIST` (what Lightning's `demos.mnist_datamodule.MNIST` returns) on generated
    pixels: the same sizes and dtypes, each item `(transform(image), label)` with the image a (28, 28) uint8
    array, the same in every process and framework (its own generator: the global RNG is left as it was).
    `root` and `download` are accepted and unused: nothing is read or downloaded."""

    def __init__(
        self,
        root: str,
        train: bool = True,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        download: bool = False,
    ) -> None:
        super().__init__()
        self.train, self.transform, self.target_transform = train, transform, target_transform
        generator = torch.Generator().manual_seed(1 if train else 2)
        n = SIZES[train]
        self.data = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=generator)
        self.targets = torch.randint(0, 10, (n,), generator=generator)

    def __getitem__(self, idx: int) -> tuple[Any, Any]:
        image, target = self.data[idx].numpy(), int(self.targets[idx])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def __len__(self) -> int:
        return len(self.data)


class ToTensor:
    """torchvision's `transforms.ToTensor` for arrays: an (H, W) or (H, W, C) uint8 image to a float
    (C, H, W) tensor in [0, 1]."""

    def __call__(self, image: np.ndarray) -> Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(image))
        if tensor.dim() == 2:
            tensor = tensor.unsqueeze(-1)
        return tensor.permute(2, 0, 1).float().div(255)
