"""What the examples download or take from torchvision, generated here (the tests run offline, without
torchvision): MNIST on generated pixels, and the pieces of torchvision's `transforms` and `utils` the examples
call (`ToTensor`, `Compose`, `Resize`, `RandomHorizontalFlip`, `Normalize`, `make_grid`), each with
torchvision's behaviour for the inputs the examples give it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
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
    """torchvision's `transforms.ToTensor` for arrays and PIL images: an (H, W) or (H, W, C) uint8 image to a
    float (C, H, W) tensor in [0, 1]."""

    def __call__(self, image: np.ndarray | Image.Image) -> Tensor:
        tensor = torch.from_numpy(np.array(image, dtype=np.uint8))
        if tensor.dim() == 2:
            tensor = tensor.unsqueeze(-1)
        return tensor.permute(2, 0, 1).float().div(255)


class Compose:
    """torchvision's `transforms.Compose`: the transforms one after the other."""

    def __init__(self, transforms: Sequence[Callable]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


class Resize:
    """torchvision's `transforms.Resize((height, width))` of a PIL image: bilinear, as torchvision's default."""

    def __init__(self, size: tuple[int, int]) -> None:
        self.size = size

    def __call__(self, image: Image.Image) -> Image.Image:
        height, width = self.size
        return image.resize((width, height), Image.Resampling.BILINEAR)


class RandomHorizontalFlip:
    """torchvision's `transforms.RandomHorizontalFlip(p)` of a PIL image: flipped when `torch.rand(1) < p`
    (one draw from the global torch generator per image, as torchvision's)."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, image: Image.Image) -> Image.Image:
        if torch.rand(1) < self.p:
            return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return image


class Normalize:
    """torchvision's `transforms.Normalize(mean, std)` of a (C, H, W) tensor, channel by channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean, self.std = mean, std

    def __call__(self, tensor: Tensor) -> Tensor:
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return tensor.sub(mean).div(std)


def make_grid(tensor: Tensor, nrow: int = 8, padding: int = 2, pad_value: float = 0.0) -> Tensor:
    """torchvision's `utils.make_grid` of a (B, C, H, W) batch (without its normalizing options): the images in
    rows of `nrow`, `padding` pixels of `pad_value` around each, one channel repeated to three."""
    if tensor.size(1) == 1:
        tensor = torch.cat((tensor, tensor, tensor), 1)
    if tensor.size(0) == 1:
        return tensor.squeeze(0)
    count = tensor.size(0)
    columns = min(nrow, count)
    rows = math.ceil(count / columns)
    height, width = tensor.size(2) + padding, tensor.size(3) + padding
    grid = tensor.new_full((tensor.size(1), height * rows + padding, width * columns + padding), pad_value)
    for k in range(count):
        y, x = divmod(k, columns)
        top, left = y * height + padding, x * width + padding
        grid[:, top : top + height - padding, left : left + width - padding].copy_(tensor[k])
    return grid
