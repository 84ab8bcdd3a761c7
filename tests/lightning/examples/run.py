"""Runs one of Lightning's examples (vendored beside this file) as its main does, on PyTorch Lightning or on this
project, the example's imports (framework.py) being the only difference:

    python run.py {lightning|trainer} EXAMPLE OUT FLAGS --devices N

FLAGS: a JSON object of Trainer arguments, as a user passes them on the command line
(`--trainer.max_epochs=2`); DEVICES > 1 runs DDP on that many CPU processes. Both runs log to a CSVLogger
(`--trainer.logger`) in OUT/logs and record what they observe (`Recorder`, `fit_record`); each rank writes
OUT/rank<R>.json. MAINS says how each example's main is run; adding an example is its file, one entry
there and a test."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

_parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_parser.add_argument("framework", choices=["lightning", "trainer"])
_parser.add_argument("example")
_parser.add_argument("out", type=Path)
_parser.add_argument("flags", type=json.loads)
_parser.add_argument("--devices", type=int, required=True)
_args = _parser.parse_args()
os.environ["EXAMPLES_FRAMEWORK"] = _args.framework

import framework  # noqa: E402 (after the choice of framework it reads)

from trainer.core.launch import destroy_process_group  # noqa: E402


class Recorder(framework.callbacks.Callback):
    """What a user watching the run sees after each optimizer step and each validation: the step counter,
    the epoch and the values logged so far."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.validations: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        entry = {"epoch": trainer.current_epoch, "step": trainer.global_step, "batch_idx": batch_idx}
        self.steps.append({**entry, "metrics": plain(dict(trainer.callback_metrics))})

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            entry = {"epoch": trainer.current_epoch, "step": trainer.global_step}
            self.validations.append({**entry, "metrics": plain(dict(trainer.callback_metrics))})


def plain(value: Any) -> Any:
    """JSON's types: tensors as (nested) lists of numbers."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def checkpoints(trainer: Any, model: Any) -> dict:
    """What the run's ModelCheckpoint keeps in its folder (Lightning: `NAME.ckpt` files, here `NAME/`
    directories), the step each holds (from its name), and the checkpoint `ckpt_path="best"` reads, with the
    weights `load_from_checkpoint` gives from it."""
    callback = trainer.checkpoint_callback
    # hidden files are no checkpoints: here the live fit's `.lock`, which another rank may still see
    kept = sorted(p.name for p in Path(callback.dirpath).iterdir() if not p.name.startswith("."))
    best = type(model).load_from_checkpoint(callback.best_model_path)
    return {
        "kept": kept,
        "steps": [int(re.search(r"step[=-](\d+)", name).group(1)) for name in kept],
        "best": Path(callback.best_model_path).name,
        "best_weights": weights(best),
    }


def weights(model: Any) -> dict[str, list[float]]:
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def follow_train_loader_shuffle() -> None:
    """The README's difference on purpose, applied to Lightning's run as the parity tests apply theirs: a
    train loader with `shuffle=False` stays unshuffled under DDP (Lightning shuffles its DistributedSampler
    whatever the loader says)."""
    from pytorch_lightning.trainer.connectors import data_connector
    from pytorch_lightning.trainer.states import RunningStage
    from pytorch_lightning.utilities.data import _is_dataloader_shuffled

    lightning_sampler = data_connector._get_distributed_sampler

    def sampler(dataloader: Any, shuffle: bool, *args: Any, mode: Any = None, **kwargs: Any) -> Any:
        if mode == RunningStage.TRAINING:
            shuffle = _is_dataloader_shuffled(dataloader)
        return lightning_sampler(dataloader, shuffle, *args, mode=mode, **kwargs)

    data_connector._get_distributed_sampler = sampler


def fit_record(trainer: Any, model: Any, logger: Any) -> dict:
    """What a fit leaves for its user: its step and epoch, `callback_metrics` and `logged_metrics`, the
    weights, the checkpoints and the CSV log."""
    return {
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "callback_metrics": plain(dict(trainer.callback_metrics)),
        "logged_metrics": plain(dict(trainer.logged_metrics)),
        "weights": weights(model),
        "checkpoints": checkpoints(trainer, model),
        "metrics_csv": (Path(logger.log_dir) / "metrics.csv").read_text(),
    }


def lightning_cli_main(
    model_class: str, trainer_defaults: dict, example: ModuleType, flags: dict, out: Path
) -> dict:
    """An example's `cli_main`: `LightningCLI(model_class, MyDataModule, seed_everything_default=1234,
    trainer_defaults=..., run=False)`, then fit, test(ckpt_path="best") and predict(ckpt_path="best").
    LightningCLI is not built here (and needs jsonargparse): its objects are built as it builds them, seed
    1234 (workers seeded), the module and the datamodule with their defaults, the Trainer with
    `trainer_defaults` (less what needs torchvision) and FLAGS. Its SaveConfigCallback (config.yaml) is left
    out."""
    framework.seed_everything(1234, workers=True)
    model = getattr(example, model_class)()
    datamodule = example.MyDataModule()
    recorder = Recorder()
    logger = framework.CSVLogger(out, name="logs")
    trainer = framework.Trainer(**{**trainer_defaults, **flags}, callbacks=[recorder], logger=logger)
    trainer.fit(model, datamodule=datamodule)
    fit = fit_record(trainer, model, logger)
    tested = trainer.test(ckpt_path="best", datamodule=datamodule)
    predictions = trainer.predict(ckpt_path="best", datamodule=datamodule)
    return {
        "fit": fit,
        "steps": recorder.steps,
        "validations": recorder.validations,
        "test": plain(tested),
        "predict": plain(predictions),
        "rank_zero_only": framework.rank_zero_only(lambda: "ran")(),
        "global_rank": trainer.global_rank,
    }


# how each example's main runs: (example module, FLAGS, OUT) -> its record
MAINS: dict[str, Callable[[ModuleType, dict, Path], dict]] = {
    # ImageSampler, its other trainer default, needs torchvision (its constructor raises without it)
    "autoencoder": functools.partial(lightning_cli_main, "LitAutoEncoder", {"max_epochs": 10}),
    "backbone_image_classifier": functools.partial(lightning_cli_main, "LitClassifier", {}),
}


def main() -> None:
    torch.set_num_threads(1)
    if _args.framework == "lightning" and _args.devices > 1:
        follow_train_loader_shuffle()
    devices = {
        "accelerator": "cpu",
        "devices": _args.devices,
        "strategy": "ddp" if _args.devices > 1 else "auto",
    }
    example = __import__(_args.example)
    record = MAINS[_args.example](example, {**_args.flags, **devices}, _args.out)
    _args.out.mkdir(parents=True, exist_ok=True)
    (_args.out / f"rank{record['global_rank']}.json").write_text(json.dumps(record))
    if torch.distributed.is_initialized():
        # every rank's record is written before rank 0 ends the job: Lightning's launcher does not wait for
        # the ranks it started, which end with it
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
    # Lightning leaves its gloo group to the interpreter's finalisation, where its threads can abort the
    # process after the run (tests/scripts/lightning_parity.py): shut it down here
    destroy_process_group()
