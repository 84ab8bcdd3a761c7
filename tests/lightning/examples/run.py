"""Runs one of Lightning's examples (read from a checkout of Lightning: upstream.py)
as its main does, on PyTorch Lightning or on this project, the example's imports (framework.py) being the only
difference:

    python run.py {lightning|trainer} EXAMPLE OUT FLAGS --devices N [--arguments ARGUMENTS]

FLAGS: a JSON object of Trainer arguments, as a user passes them on the command line
(`--trainer.max_epochs=2`); ARGUMENTS: the example's own command-line arguments, a JSON object
(`{"data.batch_size": 2}` for `--data.batch_size=2`); DEVICES > 1 runs DDP on that many CPU processes (FLAGS
may name the strategy). Both runs log where the example's main does (a CSVLogger in OUT/logs for a
LightningCLI example, Lightning's default TensorBoardLogger otherwise) and record what they observe
(`Recorder`, `fit_record`); each rank writes OUT/rank<R>.pt (torch.save: the weights and images as
tensors, the rest plain values). MAINS says how each example's main is run;
adding an example is its entry in upstream.py, one entry there and a test."""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

_parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_parser.add_argument("framework", choices=["lightning", "trainer"])
_parser.add_argument("example")
_parser.add_argument("out", type=Path)
_parser.add_argument("flags", type=json.loads)
_parser.add_argument("--devices", type=int, required=True)
_parser.add_argument("--arguments", type=json.loads, default={})
_args = _parser.parse_args()
os.environ["EXAMPLES_FRAMEWORK"] = _args.framework

import framework  # noqa: E402 (after the choice of framework it reads)
import upstream  # noqa: E402

from trainer.core.launch import destroy_process_group  # noqa: E402
from trainer.core.rng import isolated_rng  # noqa: E402


class Recorder(framework.callbacks.Callback):
    """What a user watching the run sees after each training batch and each validation: the step counter,
    the epoch and the values logged so far; and what each batch trains (read at its start): each
    optimizer's param groups (learning rate and parameter count: what fine-tuning callbacks and schedulers
    change) and how many parameters require gradients."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.validations: list[dict] = []
        self.training: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # at the batch's start: the rates this batch trains with (an epoch's scheduler steps in its last batch)
        groups = [[[g["lr"], len(g["params"])] for g in opt.param_groups] for opt in trainer.optimizers]
        self.training = {
            "param_groups": groups,
            "trainable": sum(p.requires_grad for p in pl_module.parameters()),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        entry = {"epoch": trainer.current_epoch, "step": trainer.global_step, "batch_idx": batch_idx}
        self.steps.append({**entry, **self.training, "metrics": plain(dict(trainer.callback_metrics))})

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            entry = {"epoch": trainer.current_epoch, "step": trainer.global_step}
            self.validations.append({**entry, "metrics": plain(dict(trainer.callback_metrics))})


def plain(value: Any) -> Any:
    """Plain values for the record: tensors as (nested) lists of numbers (what pytest.approx compares)."""
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
    # rank zero deletes the checkpoints it no longer keeps: another rank lists the folder after it is done
    trainer.strategy.barrier()
    # hidden files are no checkpoints: here the live fit's `.lock`, which another rank may still see
    kept = sorted(p.name for p in Path(callback.dirpath).iterdir() if not p.name.startswith("."))
    best = type(model).load_from_checkpoint(callback.best_model_path)
    return {
        "kept": kept,
        "steps": [int(re.search(r"step[=-](\d+)", name).group(1)) for name in kept],
        "best": Path(callback.best_model_path).name,
        "best_weights": weights(best),
    }


def weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


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


def isolate_evaluation_rng() -> None:
    """The README's difference on purpose, applied to Lightning's run: its evaluation loops (validation in a
    fit) run on a copy of the RNG streams, as here, so validating does not move the training's (Lightning's
    val loader draws its iterator's base seed from the global generator, which changes a shuffled train
    loader's next order and the random transforms)."""
    from pytorch_lightning.loops.evaluation_loop import _EvaluationLoop

    lightning_run = _EvaluationLoop.run

    def run(self: Any) -> Any:
        with isolated_rng():
            return lightning_run(self)

    _EvaluationLoop.run = run


def fit_record(trainer: Any, model: Any) -> dict:
    """What a fit leaves for its user: its step and epoch, `callback_metrics` and `logged_metrics`, the
    weights and the checkpoints."""
    return {
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "callback_metrics": plain(dict(trainer.callback_metrics)),
        "logged_metrics": plain(dict(trainer.logged_metrics)),
        "weights": weights(model),
        "checkpoints": checkpoints(trainer, model),
    }


def tensorboard_record(log_dir: str) -> dict:
    """What TensorBoard shows of a run's event files: each scalar's (step, value) points and each image's
    steps and pixels, by tag."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir, size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    images = {}
    for tag in tags["images"]:
        images[tag] = [
            [e.step, torch.from_numpy(np.array(Image.open(io.BytesIO(e.encoded_image_string))))]
            for e in events.Images(tag)
        ]
    scalars = {tag: [[e.step, e.value] for e in events.Scalars(tag)] for tag in tags["scalars"]}
    return {"scalars": scalars, "images": images}


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
    fit = {**fit_record(trainer, model), "metrics_csv": (Path(logger.log_dir) / "metrics.csv").read_text()}
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


def gan_main(example: ModuleType, flags: dict, out: Path, arguments: dict) -> dict:
    """generative_adversarial_net.py's `main(args)` with its parser's defaults (or ARGUMENTS `lr`, `b1`, `b2`,
    `latent_dim`): GAN(...), MNISTDataModule(), Trainer(accelerator="gpu", devices=1), fit(model, dm). Here
    FLAGS override the Trainer's arguments (the accelerator and devices too), a seed is set first (main sets
    none, and both runs must start from the same weights and noise), the datamodule reads without workers
    (main's default is 16) and the logger is Lightning's default where tensorboard is installed, a
    TensorBoardLogger in OUT/logs, given explicitly (this Trainer's default is its JSONL log), where the
    example writes its images (`logger.experiment.add_image`)."""
    framework.seed_everything(1234)
    hyper = {"lr": 0.0002, "b1": 0.5, "b2": 0.999, "latent_dim": 100}
    model = example.GAN(**{k: arguments.get(k, v) for k, v in hyper.items()})
    datamodule = framework.MNISTDataModule(num_workers=0)
    recorder = Recorder()
    logger = framework.TensorBoardLogger(out, name="logs")
    trainer_args = {"accelerator": "gpu", "devices": 1, **flags}
    trainer = framework.Trainer(**trainer_args, callbacks=[recorder], logger=logger)
    trainer.fit(model, datamodule)
    events = tensorboard_record(logger.log_dir) if trainer.is_global_zero else None  # rank zero's writer
    return {
        "fit": {**fit_record(trainer, model), "tensorboard": events},
        "steps": recorder.steps,
        "validations": recorder.validations,
        "global_rank": trainer.global_rank,
    }


def fine_tuning_cli_main(example: ModuleType, flags: dict, out: Path, arguments: dict) -> dict:
    """computer_vision_fine_tuning.py's `cli_main`, `MyLightningCLI(TransferLearningModel,
    CatDogImageDataModule, seed_everything_default=1234)` run as `fit` with ARGUMENTS (`data.batch_size`,
    `data.dl_path`, `finetuning.milestones`, `finetuning.train_bn`) and FLAGS as `--trainer.*`, built as it
    builds them (LightningCLI is not built here): seed_everything(1234, workers=True); MilestonesFinetuning
    (its `finetuning` arguments), the datamodule and the module with batch_size, milestones and train_bn linked
    from them; the Trainer with MyLightningCLI's defaults (max_epochs=15, enable_model_summary=False,
    num_sanity_val_steps=0), FLAGS and a CSVLogger in OUT/logs; then fit. SaveConfigCallback is left out."""
    framework.seed_everything(1234, workers=True)
    finetuning = {"milestones": (5, 10), "train_bn": False}
    finetuning = {k: arguments.get(f"finetuning.{k}", v) for k, v in finetuning.items()}
    data = {"dl_path": "data", "num_workers": 0, "batch_size": 8}
    data = {k: arguments.get(f"data.{k}", v) for k, v in data.items()}
    callback = example.MilestonesFinetuning(**finetuning)
    datamodule = example.CatDogImageDataModule(**data)
    model = example.TransferLearningModel(batch_size=data["batch_size"], **finetuning)
    recorder = Recorder()
    logger = framework.CSVLogger(out, name="logs")
    defaults = {"max_epochs": 15, "enable_model_summary": False, "num_sanity_val_steps": 0}
    trainer = framework.Trainer(**{**defaults, **flags}, callbacks=[recorder, callback], logger=logger)
    trainer.fit(model, datamodule=datamodule)
    fit = {**fit_record(trainer, model), "metrics_csv": (Path(logger.log_dir) / "metrics.csv").read_text()}
    return {
        "fit": fit,
        "steps": recorder.steps,
        "validations": recorder.validations,
        "global_rank": trainer.global_rank,
    }


def load_example(name: str) -> ModuleType:
    """Example `name`, read from Lightning's checkout with its imports replaced (upstream.py)."""
    return upstream.load(name)


def without_arguments(main: Callable[[ModuleType, dict, Path], dict]) -> Callable[..., dict]:
    """A main that takes no command-line arguments of its own."""
    return lambda example, flags, out, arguments: main(example, flags, out)


# how each example's main runs: (example module, FLAGS, OUT, ARGUMENTS) -> its record
MAINS: dict[str, Callable[[ModuleType, dict, Path, dict], dict]] = {
    # ImageSampler, its other trainer default, needs torchvision (its constructor raises without it)
    "autoencoder": without_arguments(
        functools.partial(lightning_cli_main, "LitAutoEncoder", {"max_epochs": 10})
    ),
    "backbone_image_classifier": without_arguments(
        functools.partial(lightning_cli_main, "LitClassifier", {})
    ),
    "generative_adversarial_net": gan_main,
    "computer_vision_fine_tuning": fine_tuning_cli_main,
}


def main() -> None:
    torch.set_num_threads(1)
    if _args.framework == "lightning":
        isolate_evaluation_rng()
        if _args.devices > 1:
            follow_train_loader_shuffle()
    devices = {
        "accelerator": "cpu",
        "devices": _args.devices,
        "strategy": "ddp" if _args.devices > 1 else "auto",
    }
    example = load_example(_args.example)
    record = MAINS[_args.example](example, {**devices, **_args.flags}, _args.out, _args.arguments)
    _args.out.mkdir(parents=True, exist_ok=True)
    torch.save(record, _args.out / f"rank{record['global_rank']}.pt")
    if torch.distributed.is_initialized():
        # every rank's record is written before rank 0 ends the job: Lightning's launcher does not wait for
        # the ranks it started, which end with it
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
    # Lightning leaves its gloo group to the interpreter's finalisation, where its threads can abort the
    # process after the run (tests/scripts/lightning_parity.py): shut it down here
    destroy_process_group()
