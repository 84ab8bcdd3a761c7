"""Local data read into Hugging Face datasets, and a run's train and validation splits of them."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.data.rows import remember_origin
from trainer.data.unreadable import read_data

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

# data-file suffix -> the datasets builder that reads it
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
VALIDATION_SPLITS = ("validation", "test")  # a DatasetDict's split used for validation, first found


def load_hf_dataset(path: str | os.PathLike[str], split: str | None = None) -> Dataset | DatasetDict:
    """A dataset from a local `path`: a `save_to_disk` folder (as saved), a data file (one Dataset, its
    "train" split unless `split`), or a folder of data files (splits named by the files, as datasets infers)."""
    import datasets

    location = Path(path)
    if not location.exists():
        raise FileNotFoundError(
            f"dataset path {str(location)!r} does not exist; allowed: a folder saved with save_to_disk, or a "
            f"{'/'.join(DATA_FILE_BUILDERS)} file or a folder of them"
        )
    if location.is_file():
        builder = DATA_FILE_BUILDERS.get(location.suffix.lower())
        if builder is None:
            raise ValueError(
                f"{str(location)!r} is not a known data file; allowed: a file ending in {', '.join(DATA_FILE_BUILDERS)}"
            )
        loaded = read_data(location, [location], builder, data_files=str(location), split=split or "train")
        return remember_origin(loaded, location)
    if (location / "dataset_dict.json").is_file() or (location / "state.json").is_file():
        return _select_split(datasets.load_from_disk(str(location)), split, location)
    files = sorted(file for file in location.rglob("*") if file.suffix.lower() in DATA_FILE_BUILDERS)
    if not files:
        raise ValueError(
            f"{str(location)!r} holds neither a save_to_disk dataset nor data files; allowed: a folder saved "
            f"with save_to_disk, or one with {'/'.join(DATA_FILE_BUILDERS)} files"
        )
    return read_data(location, files, None, split=split)


def _select_split(loaded: Dataset | DatasetDict, split: str | None, location: Path) -> Dataset | DatasetDict:
    """`split` of a dataset read with load_from_disk (all of it when None)."""
    from datasets import DatasetDict

    if split is None:
        return loaded
    if not isinstance(loaded, DatasetDict):
        raise ValueError(f"{str(location)!r} holds one Dataset without splits; allowed: split=None")
    if split not in loaded:
        raise ValueError(f"{str(location)!r} has no split {split!r}; allowed: one of {list(loaded)}")
    return loaded[split]


def _with_validation(source: Any, val_path: Any) -> DatasetDict:
    """`source`'s train split with `val_path`'s examples as its "validation" split."""
    from datasets import Dataset, DatasetDict

    val = load_hf_dataset(val_path) if isinstance(val_path, (str, os.PathLike)) else val_path
    if not isinstance(val, Dataset):
        raise ValueError(
            f"val_path holds a {type(val).__name__}; allowed: one split (a data file, a save_to_disk Dataset or "
            "a datasets.Dataset), or eval_split to pick one of a DatasetDict"
        )
    train = source["train"] if isinstance(source, DatasetDict) and "train" in source else source
    return DatasetDict(train=train, validation=val)


def _splits(
    data: Any, val_fraction: float, seed: int, eval_split: str | None = None
) -> tuple[Dataset, Dataset | None]:
    """(train, validation or None): a DatasetDict's own splits, else `val_fraction` split off with `seed`."""
    from datasets import Dataset, DatasetDict

    if isinstance(data, DatasetDict):
        if "train" not in data:
            raise ValueError(f"the DatasetDict has splits {list(data)}; allowed: one with a 'train' split")
        if eval_split is not None and eval_split not in data:
            raise ValueError(
                f"eval_split={eval_split!r} is not a split of the data; allowed: one of {list(data)}"
            )
        names = (eval_split,) if eval_split is not None else VALIDATION_SPLITS
        val_name = next((name for name in names if name in data), None)
        if val_name is not None:
            return data["train"], data[val_name]
        data = data["train"]
    elif eval_split is not None:
        raise ValueError(
            f"eval_split={eval_split!r} picks a split of a DatasetDict, and the data is one Dataset; allowed: "
            "val_path or val_fraction"
        )
    if not isinstance(data, Dataset):
        raise TypeError(
            f"data is a {type(data).__name__}; allowed: a path, a datasets.Dataset or a DatasetDict (map-style)"
        )
    if val_fraction == 0:
        return data, None
    if len(data) - math.ceil(len(data) * val_fraction) < 1:
        raise ValueError(
            f"{len(data)} examples leave none for training after val_fraction={val_fraction}; allowed: more "
            "examples, val_fraction=0, or a DatasetDict with a 'validation' split"
        )
    parts = data.train_test_split(test_size=val_fraction, seed=seed)
    return parts["train"], parts["test"]
