"""Lightning's `demos.mnist_datamodule.MNISTDataModule` (the GAN example's data), over the generated MNIST
(standins.py) and as it runs where torchvision is installed (`transforms.ToTensor()`, normalized to [-1, 1]
with `normalize=True`). Lightning's own cannot run here: without torchvision its `MNIST` raises, and with it
it downloads. framework.py puts these methods on each framework's LightningDataModule."""

from __future__ import annotations

from standins import MNIST, Compose, Normalize, ToTensor
from torch import Generator
from torch.utils.data import DataLoader, random_split


class MNISTDataMethods:
    """The demo datamodule's arguments, splits and loaders: the training set less `val_split` images (split
    with a fixed generator, as Lightning's), shuffled and without the last incomplete batch."""

    name = "mnist"

    def __init__(
        self,
        data_dir: str = "./data",
        val_split: int = 5000,
        num_workers: int = 16,
        normalize: bool = False,
        seed: int = 42,
        batch_size: int = 32,
    ) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.val_split = val_split
        self.num_workers = num_workers
        self.normalize = normalize
        self.seed = seed
        self.batch_size = batch_size

    @property
    def num_classes(self) -> int:
        return 10

    def prepare_data(self) -> None:
        MNIST(self.data_dir, train=True, download=True)
        MNIST(self.data_dir, train=False, download=True)

    def setup(self, stage: str) -> None:
        dataset = MNIST(self.data_dir, train=True, download=False, transform=self.default_transforms)
        train_length = len(dataset)
        # Lightning's seeds this split with 42 whatever `seed` says
        self.dataset_train, self.dataset_val = random_split(
            dataset, [train_length - self.val_split, self.val_split], generator=Generator().manual_seed(42)
        )

    def _loader(self, dataset: object, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            drop_last=True,
            pin_memory=True,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.dataset_train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.dataset_val, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(
            MNIST(self.data_dir, train=False, transform=self.default_transforms), shuffle=False
        )

    @property
    def default_transforms(self) -> ToTensor | Compose:
        if self.normalize:
            return Compose([ToTensor(), Normalize(mean=(0.5,), std=(0.5,))])
        return ToTensor()
