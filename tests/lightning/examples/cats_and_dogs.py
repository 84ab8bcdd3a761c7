"""What the fine-tuning example downloads, generated here: the "cats and dogs" archive
(`download_and_extract_archive` writes its folder tree, empty), `ImageFolder` over that tree with generated
pictures in place of the JPEG files, and `get_torchvision_model("resnet50", weights=...)` as a small network
with ResNet-50's children and its 2048 features (the pretrained weights are a download: its weights are drawn
from the global generator instead)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor, nn
from torch.utils.data import Dataset

# cats_and_dogs_filtered's layout and sizes: pictures per class in each split
ARCHIVE = "cats_and_dogs_filtered"
PICTURES = {"train": 1000, "validation": 500}
CLASSES = ("cats", "dogs")


def download_and_extract_archive(
    url: str, download_root: str | Path, remove_finished: bool = False, **_: Any
) -> None:
    """torchvision's download of `url` into `download_root`, extracted: here the archive's folders, whose
    pictures `ImageFolder` generates."""
    for split in PICTURES:
        for name in CLASSES:
            (Path(download_root) / ARCHIVE / split / name).mkdir(parents=True, exist_ok=True)


class ImageFolder(Dataset):
    """torchvision's `datasets.ImageFolder(root, transform)`: the classes are `root`'s sub-folders (sorted),
    each item `(transform(picture), class index)`, the pictures of a class in turn. The pictures are RGB PIL
    images of a few sizes, generated from the split, the class and the index (the same in every process)."""

    def __init__(self, root: str | Path, transform: Callable | None = None) -> None:
        root = Path(root)
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        if not self.classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {root}.")
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.split, self.transform = root.name, transform
        self.targets = [i for i in range(len(self.classes)) for _ in range(PICTURES[self.split])]

    def __getitem__(self, index: int) -> tuple[Any, int]:
        generator = torch.Generator().manual_seed(list(PICTURES).index(self.split) * 100_000 + index)
        height, width = (int(s) for s in torch.randint(40, 80, (2,), generator=generator))
        pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
        picture = Image.fromarray(pixels.numpy(), mode="RGB")
        return (picture if self.transform is None else self.transform(picture)), self.targets[index]

    def __len__(self) -> int:
        return len(self.targets)


def _stage(channels_in: int, channels_out: int, kernel: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, kernel, stride, kernel // 2, bias=False),
        nn.BatchNorm2d(channels_out),
        nn.ReLU(inplace=True),
    )


class ResNet50Shaped(nn.Module):
    """torchvision's ResNet-50 as the example reads it: the children conv1, bn1, relu, maxpool, layer1..4,
    avgpool, fc in that order, 2048 features after avgpool, (N, 3, 224, 224) in; each layer one small
    convolution stage (ResNet-50's bottleneck blocks would make each test step seconds long)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = _stage(8, 16, 3, 1)
        self.layer2 = _stage(16, 32, 3, 2)
        self.layer3 = _stage(32, 64, 3, 2)
        self.layer4 = _stage(64, 2048, 1, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def get_torchvision_model(model_name: str, **kwargs: Any) -> nn.Module:
    """Lightning's `get_torchvision_model` (torchvision's `models.get_model`) for "resnet50": `weights` is
    taken and not downloaded."""
    if model_name != "resnet50":
        raise ValueError(f"model_name={model_name!r} has no stand-in; allowed: 'resnet50'")
    return ResNet50Shaped(num_classes=kwargs.get("num_classes", 1000))
