"""The everyday Lightning API around fit, written as Lightning's docs write it: torchmetrics metrics in
`self.log`, the trainer attributes modules read (`estimated_stepping_batches` in `configure_optimizers`),
the entry points' keywords, `devices`, EarlyStopping's and LearningRateMonitor's arguments,
`seed_everything(workers=True)` and a DataModule's hyperparameters. Runs on PyTorch Lightning are in
test_lightning_parity.py; here each value is checked against one computed independently."""

from __future__ import annotations

import logging
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import Regression, quiet, read_metrics, regression_loader
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from strategies import SingleDeviceStrategy
from trainer import DataModule, Trainer, TrainModule, seed_everything


def blobs(n: int = 48, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    return TensorDataset(torch.randn(n, 4, generator=g) + F.one_hot(y, 4).float(), y)


class Frozen(TrainModule):
    """A linear classifier that never moves (lr 0), so what its metrics should say is known beforehand."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 3)
        self.train_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.counts_at_start: list[tuple[str, int]] = []

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc)
        return F.cross_entropy(logits, y)

    def on_train_epoch_start(self):
        self.counts_at_start.append(("train", self.train_acc.update_count))

    def on_validation_epoch_start(self):
        self.counts_at_start.append(("val", self.val_acc.update_count))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def accuracy(module: TrainModule, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return (module(x).argmax(-1) == y).float().mean().item()


def test_a_torchmetrics_metric_logs_its_batch_value_per_step_and_compute_per_epoch_then_resets(tmp_path):
    train, val = blobs(48, seed=0), blobs(24, seed=1)
    module = Frozen()
    trainer = Trainer(max_epochs=2, default_root_dir=tmp_path, enable_checkpointing=False, **quiet())
    trainer.fit(module, DataLoader(train, batch_size=8), DataLoader(val, batch_size=8))
    per_step = read_metrics(tmp_path, "train_acc_step")
    batches = [TensorDataset(*(t[i : i + 8] for t in train.tensors)) for i in range(0, 48, 8)]
    assert list(per_step.values()) == pytest.approx([accuracy(module, b) for b in batches] * 2)
    assert list(read_metrics(tmp_path, "train_acc_epoch").values()) == pytest.approx(
        [accuracy(module, train)] * 2
    )
    assert trainer.callback_metrics["val_acc"] == pytest.approx(accuracy(module, val))
    # every epoch and every validation (the sanity check's included) starts from a reset metric
    assert module.counts_at_start == [("val", 0), ("train", 0), ("val", 0), ("train", 0), ("val", 0)]


def test_a_validated_checkpoint_does_not_count_its_held_out_batch_into_a_metric(tmp_path):
    counts = []

    class Counting(Frozen):
        def on_validation_epoch_end(self):
            counts.append(self.val_acc.update_count)

    trainer = Trainer(
        max_steps=4, val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0, default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(every_n_steps=1)], **quiet(),
    )  # fmt: skip
    trainer.fit(Counting(), DataLoader(blobs(), batch_size=8), DataLoader(blobs(seed=1), batch_size=8))
    assert counts == [2, 2]  # each validation's two batches, not the checkpoints' reload checks


def test_log_refuses_what_is_neither_a_number_a_tensor_nor_a_metric(tmp_path):
    class LogsAString(Regression):
        def training_step(self, batch, batch_idx):
            self.log("name", "text")
            return super().training_step(batch, batch_idx)

    with pytest.raises(TypeError, match="allowed: a number, a scalar tensor or a torchmetrics Metric"):
        Trainer(max_steps=1, default_root_dir=tmp_path, **quiet()).fit(LogsAString(), regression_loader())


def test_a_metric_whose_compute_is_not_a_scalar_is_named(tmp_path):
    class PerClass(Frozen):
        def __init__(self):
            super().__init__()
            self.train_acc = MulticlassAccuracy(num_classes=3, average=None)  # one value per class

    trainer = Trainer(max_steps=2, default_root_dir=tmp_path, enable_checkpointing=False, **quiet())
    with pytest.raises(
        ValueError,
        match=r"log\('train_acc'\): MulticlassAccuracy.compute\(\) returned a tensor of shape \(3,\)",
    ):
        trainer.fit(PerClass(), DataLoader(blobs(), batch_size=8))


class Recorded(Regression):
    """Records, inside configure_optimizers, what Lightning users read there."""

    def configure_optimizers(self):
        self.seen = (self.trainer.estimated_stepping_batches, self.trainer.num_training_batches)
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"max_epochs": 2, "accumulate_grad_batches": 3, "limit_train_batches": 7}, (6, 7)),  # ceil(7/3) x 2
        ({"max_epochs": 2, "max_steps": 5, "accumulate_grad_batches": 3, "limit_train_batches": 7}, (5, 7)),
        ({"max_epochs": 1, "limit_train_batches": 0.5}, (8, 8)),  # half of 16 batches
    ],
)
def test_estimated_stepping_batches_is_known_in_configure_optimizers_and_is_the_steps_taken(
    tmp_path, flags, expected
):
    module = Recorded()
    trainer = Trainer(default_root_dir=tmp_path, enable_checkpointing=False, **quiet(**flags))
    trainer.fit(model=module, train_dataloaders=regression_loader())
    assert module.seen == expected
    assert trainer.global_step == expected[0]


def test_an_iterable_without_len_has_unbounded_stepping_batches(tmp_path):
    loader = (batch for batch in regression_loader())
    module = Recorded()
    Trainer(max_epochs=1, default_root_dir=tmp_path, enable_checkpointing=False, **quiet()).fit(
        module, loader
    )
    assert module.seen == (math.inf, math.inf)


def test_estimated_stepping_batches_before_a_fit_says_where_to_read_it():
    with pytest.raises(RuntimeError, match="estimated_stepping_batches needs the fit's train loader"):
        Trainer().estimated_stepping_batches  # noqa: B018


def test_trainer_attributes_read_as_lightnings(tmp_path):
    first, second = ModelCheckpoint(dirpath=tmp_path / "a"), ModelCheckpoint(dirpath=tmp_path / "b")
    trainer = Trainer(
        max_epochs=1, precision="bf16-mixed", callbacks=[first, second], default_root_dir=tmp_path
    )
    assert (trainer.precision, trainer.world_size, trainer.num_devices, trainer.num_nodes) == (
        "bf16-mixed",
        1,
        1,
        1,
    )
    assert trainer.checkpoint_callbacks == [first, second] and trainer.checkpoint_callback is first
    assert (trainer.optimizers, trainer.lr_scheduler_configs, trainer.max_epochs) == ([], [], 1)

    class WithScheduler(Regression):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "frequency": 2},
            }

    module = WithScheduler()
    trainer = Trainer(max_steps=2, default_root_dir=tmp_path, enable_checkpointing=False, **quiet())
    trainer.fit(module, regression_loader())
    (config,) = trainer.lr_scheduler_configs
    assert trainer.optimizers == [module.optimizers()] and (config.interval, config.frequency) == ("epoch", 2)
    assert Trainer(devices="2").num_devices == 2 and Trainer(precision=32).precision == "32-true"


def test_devices_minus_one_is_refused_on_the_cpu_as_lightning_refuses_it():
    # Lightning's CPU accelerator: "`devices` selected with `CPUAccelerator` should be an int > 0."
    with pytest.raises(ValueError, match=r"devices=-1 \(every GPU\) with accelerator='cpu' is invalid"):
        Trainer(accelerator="cpu", devices=-1)


class Regressor(Regression):
    test_step = Regression.validation_step


class ToyData(DataModule):
    def __init__(self, batch_size: int = 16, n: int = 64):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        return regression_loader(batch_size=self.hparams.batch_size, n=self.hparams.n)

    def val_dataloader(self):
        return regression_loader(batch_size=self.hparams.batch_size, n=32)

    def test_dataloader(self):
        return regression_loader(batch_size=self.hparams.batch_size, n=32)


def test_entry_points_take_lightnings_keywords_and_a_datamodule_in_place_of_the_loaders(tmp_path):
    data = ToyData(batch_size=8)
    assert data.hparams == {"batch_size": 8, "n": 64} and data.hparams.batch_size == 8
    module = Regressor()
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, enable_checkpointing=False, **quiet())
    trainer.fit(module, data)
    assert trainer.global_step == 8  # 64 samples in batches of 8
    by_keywords = trainer.test(model=module, dataloaders=data.test_dataloader())
    assert trainer.test(module, data) == by_keywords == trainer.test(datamodule=data)  # no model: the fit's
    assert trainer.validate(dataloaders=data)["val/loss"] == pytest.approx(
        trainer.validate(model=module, dataloaders=data.val_dataloader())["val/loss"]
    )
    with pytest.raises(ValueError, match="fit got a datamodule twice"):
        trainer.fit(module, data, datamodule=data)
    with pytest.raises(TypeError, match="test got no model and this Trainer ran no fit"):
        Trainer().test(dataloaders=data.test_dataloader())


class EpochScore(Regression):
    """Logs a scripted `score` at each training epoch's end (no validation), as a module's epoch hook would."""

    def __init__(self, scores):
        super().__init__()
        self.scores = scores

    def on_train_epoch_end(self):
        self.log("score", self.scores[self.current_epoch])


@pytest.mark.parametrize(
    "arguments, scores, stopped_epoch",
    [
        ({"patience": 2}, [1.0, 1.0, 1.0, 1.0, 1.0], 2),  # two epochs without improvement
        ({"mode": "max", "stopping_threshold": 0.9}, [0.5, 0.8, 0.95, 0.99, 1.0], 2),
        ({"divergence_threshold": 10.0}, [1.0, 0.9, 11.0, 0.5, 0.4], 2),
        ({"patience": 1, "min_delta": 0.2}, [1.0, 0.7, 0.6, 0.3, 0.1], 2),  # 0.1 < min_delta
    ],
)
def test_early_stopping_checks_at_the_end_of_each_training_epoch_with_lightnings_thresholds(
    tmp_path, arguments, scores, stopped_epoch
):
    stopper = EarlyStopping("score", **arguments)
    trainer = Trainer(
        max_epochs=5, limit_train_batches=2, callbacks=[stopper], default_root_dir=tmp_path,
        enable_checkpointing=False, **quiet(),
    )  # fmt: skip
    trainer.fit(EpochScore(scores), regression_loader())
    assert stopper.stopped_epoch == stopped_epoch and trainer.current_epoch == stopped_epoch + 1
    assert trainer.global_step == 2 * (stopped_epoch + 1)


def test_early_stopping_not_strict_skips_a_missing_metric_and_verbose_reports_improvements(tmp_path, caplog):
    lenient = EarlyStopping("missing", strict=False)
    verbose = EarlyStopping("score", verbose=True)
    trainer = Trainer(
        max_epochs=3, limit_train_batches=2, callbacks=[lenient, verbose], default_root_dir=tmp_path,
        enable_checkpointing=False, **quiet(),
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer.fit(EpochScore([3.0, 2.0, 2.5]), regression_loader())
    assert trainer.current_epoch == 3 and (lenient.stopped_epoch, lenient.wait_count) == (0, 0)
    assert verbose.wait_count == 1 and float(verbose.best_score) == 2.0
    assert [r.message for r in caplog.records if "improved" in r.message] == [
        "EarlyStopping: score improved to 3",
        "EarlyStopping: score improved to 2",
    ]


def test_lr_monitor_logs_an_epoch_scheduler_per_epoch_and_step_when_asked(tmp_path):
    class EpochDecay(Regression):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    for interval, root in ((None, tmp_path / "follow"), ("step", tmp_path / "step")):
        trainer = Trainer(
            max_epochs=3, limit_train_batches=2, default_root_dir=root, enable_checkpointing=False,
            callbacks=[LearningRateMonitor(logging_interval=interval)], **quiet(),
        )  # fmt: skip
        trainer.fit(EpochDecay(), regression_loader())
    assert read_metrics(tmp_path / "follow", "lr/group0") == {0: 1.0, 2: 0.5, 4: 0.25}  # each epoch's start
    assert read_metrics(tmp_path / "step", "lr/group0") == {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.5, 5: 0.25, 6: 0.25}
    with pytest.raises(
        ValueError, match="logging_interval='batch' is invalid; allowed: 'step', 'epoch' or None"
    ):
        LearningRateMonitor(logging_interval="batch")


def test_seed_everything_workers_gives_each_loader_lightnings_worker_seeding(tmp_path, monkeypatch):
    from trainer.core.rng import SEED_WORKERS_ENV, worker_init_function

    monkeypatch.setenv(SEED_WORKERS_ENV, "0")  # put back after the test: seed_everything sets it
    seen = []

    class Draws(torch.utils.data.Dataset):
        """Each item: its worker's base seed (torch's, before worker_init_fn), its id and three draws."""

        def __len__(self):
            return 4

        def __getitem__(self, i):
            info = torch.utils.data.get_worker_info()
            draws = [random.random(), float(np.random.rand()), torch.rand(()).item()]
            return (
                torch.tensor(info.seed - info.id),
                torch.tensor(info.id),
                torch.tensor(draws, dtype=torch.float64),
            )

    class Reads(Regression):
        def training_step(self, batch, batch_idx):
            seen.append(batch)
            return self.net[0].weight.sum() * 0.0

    seed_everything(7, workers=True)
    loader = DataLoader(Draws(), batch_size=2, num_workers=2)
    Trainer(max_epochs=1, default_root_dir=tmp_path, enable_checkpointing=False, **quiet()).fit(
        Reads(), loader
    )
    assert loader.worker_init_fn is not None and len(seen) == 2
    for base, worker, draws in seen:  # the first item each worker made, against the recipe run here
        torch.manual_seed(int(base[0]) + int(worker[0]))
        worker_init_function(int(worker[0]), rank=0)
        assert draws[0].tolist() == [random.random(), float(np.random.rand()), torch.rand(()).item()]
    assert seen[0][2][0].tolist() != seen[1][2][0].tolist()


def test_a_fits_data_sampling_is_seeded_by_seed_everything_as_lightnings_distributed_sampler(tmp_path):
    """Lightning seeds the DistributedSampler it adds with seed_everything's seed (PL_GLOBAL_SEED, inherited
    by the processes a launch starts), so a DDP fit's shuffle follows the seed the script chose; the
    Trainer's own `seed` comes first, and without either it is 0."""
    seeds = []

    class RecordsTheSeed(SingleDeviceStrategy):
        def process_dataloader(self, loader, seed, train=True):
            seeds.append(seed)
            return loader

    def fit(**seed):
        trainer = Trainer(
            strategy=RecordsTheSeed(), max_steps=1, limit_val_batches=0, default_root_dir=tmp_path,
            enable_checkpointing=False, **seed, **quiet(),
        )  # fmt: skip
        trainer.fit(Regression(), regression_loader())
        return seeds.pop()

    assert fit() == 0
    seed_everything(1234)
    assert fit() == 1234
    assert fit(seed=7) == 7


def test_a_parallel_strategy_seeds_again_with_seed_everythings_seed_as_lightnings_reset_seed(tmp_path):
    """Lightning's parallel strategies call `reset_seed()` when a stage sets up: each process starts the stage
    from seed_everything's seed whatever it drew since (the GAN example's noise under DDP depends on it); a
    single-device fit continues the stream."""
    draws = {}

    class Draws(Regression):
        def training_step(self, batch, batch_idx):
            draws[key] = torch.rand(()).item()
            return super().training_step(batch, batch_idx)

    for key in [(strategy, drawn) for strategy in ("ddp", "auto") for drawn in (0, 3)]:
        strategy, drawn = key
        seed_everything(5)
        model = Draws()
        torch.rand(drawn)  # what the script draws between seeding and fitting
        Trainer(
            strategy=strategy, devices=1, max_steps=1, limit_val_batches=0, default_root_dir=tmp_path / str(key),
            enable_checkpointing=False, **quiet(),
        ).fit(model, regression_loader())  # fmt: skip
    assert draws[("ddp", 0)] == draws[("ddp", 3)]
    assert draws[("auto", 0)] != draws[("auto", 3)]


def test_a_val_loader_without_a_validation_step_is_no_validation_as_in_lightning(tmp_path, caplog):
    """Lightning skips the val loop, with a warning, when a val loader comes without a validation_step (its GAN
    example's datamodule has one): no sanity check, no validation, and the fit runs."""

    class TrainsOnly(Regression):
        validation_step = TrainModule.validation_step  # none of its own

    calls = []

    class Hooks(Callback):
        def on_validation_start(self, trainer, pl_module):
            calls.append("validation")

        def on_sanity_check_start(self, trainer, pl_module):
            calls.append("sanity check")

    trainer = Trainer(
        max_epochs=2, limit_train_batches=3, default_root_dir=tmp_path, callbacks=[Hooks()], **quiet()
    )
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer.fit(TrainsOnly(), regression_loader(), regression_loader())
    assert calls == [] and trainer.global_step == 6
    assert any("no validation_step: no validation" in r.message for r in caplog.records)


def test_worker_init_function_seeds_as_lightnings_pl_worker_init_function():
    from trainer.core.rng import worker_init_function

    seed_module = pytest.importorskip("lightning_fabric.utilities.seed")
    for worker, rank in ((0, 0), (1, 0), (3, 2)):
        draws = []
        for init in (seed_module.pl_worker_init_function, worker_init_function):
            torch.manual_seed(
                1234 + worker
            )  # what torch gives worker `worker` of a loader with base seed 1234
            init(worker, rank=rank)
            draws.append((torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist()))
        assert draws[0] == draws[1], (worker, rank)
