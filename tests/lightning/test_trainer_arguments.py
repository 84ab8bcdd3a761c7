"""Every argument of PyTorch Lightning 2.6's `Trainer.__init__`, written as a Lightning user writes it, is
taken here (never a TypeError), and where its behaviour shows on the CPU it runs side by side with real
PyTorch Lightning on the same module and data: the same steps, batches, loader calls, grad modes and
errors. What shows only under several processes (sync_batchnorm, use_distributed_sampler) runs in
tests/scripts/trainer_arguments_script.py."""

from __future__ import annotations

import contextlib
import inspect
import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from helpers import SCRIPTS, run_ranks
from lightning_twins import FRAMEWORKS
from lightning_twins import QUIET_RUN as QUIET
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer_arguments_script import FIT, BatchNormNet, dataset, state

from callbacks import Callback, EarlyStopping, PhaseTimes, Profiler
from strategies import DDPStrategy, DPSGDStrategy
from strategies.registry import build_strategy
from trainer import Trainer, TrainModule
from trainer.loggers import Logger


def api(framework: str) -> tuple[type, type, type, type]:
    """(Trainer, LightningModule, Callback, EarlyStopping) of `framework`."""
    if framework == "lightning":
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import EarlyStopping as LightningEarlyStopping

        return pl.Trainer, pl.LightningModule, pl.Callback, LightningEarlyStopping
    return Trainer, TrainModule, Callback, EarlyStopping


def loader(n: int, batch_size: int = 4, first: int = 0, shuffle: bool = False) -> DataLoader:
    """n samples whose first feature is their id (`first`, `first + 1`, ...) / 1000, a small number."""
    g = torch.Generator().manual_seed(first)
    x = torch.stack([torch.arange(first, first + n) / 1000, torch.randn(n, generator=g)], 1)
    return DataLoader(
        TensorDataset(x, torch.randn(n, 1, generator=g)), batch_size=batch_size, shuffle=shuffle
    )


def ids(x: torch.Tensor) -> list[int]:
    return [round(1000 * float(i)) for i in x[:, 0]]


def recorder(base: type) -> type:
    """A linear model on `base` that records which samples each training and validation batch held, whether
    its evaluation steps ran under inference mode, and the torch switches its training steps saw."""

    class Recorder(base):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(2, 1)
            self.train_batches: list[list[int]] = []
            self.val_batches: list[list[int]] = []
            self.modes: list[tuple[str, bool]] = []
            self.switches: set[tuple] = set()

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.train_batches.append(ids(x))
            self.switches.add(
                (
                    torch.backends.cudnn.benchmark,
                    torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled(),
                )
            )
            return F.mse_loss(self.layer(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.val_batches.append(ids(x))
            self.modes.append(("validation", self.layer(x).is_inference()))
            self.log("score", 1.0)

        def predict_step(self, batch, batch_idx):
            self.modes.append(("predict", self.layer(batch[0]).is_inference()))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Recorder


@contextlib.contextmanager
def torch_switches_kept():
    """Lightning sets the torch switches for the process (deterministic, benchmark) and keeps them; put them back."""
    kept = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.is_anomaly_enabled(),
    )
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(kept[0], warn_only=kept[1])
        torch.backends.cudnn.benchmark = kept[2]
        torch.autograd.set_detect_anomaly(kept[3])


def fit(framework: str, tmp_path, module, *loaders, **kwargs):
    """`framework`'s Trainer(**QUIET, **kwargs).fit(module, *loaders); returns the Trainer."""
    trainer_cls = api(framework)[0]
    with torch_switches_kept():
        trainer = trainer_cls(default_root_dir=tmp_path / framework, **{**QUIET, **kwargs})
        trainer.fit(module, *loaders)
    return trainer


def test_every_argument_of_lightnings_trainer_is_taken_with_lightnings_default(tmp_path, monkeypatch):
    import pytorch_lightning as pl

    monkeypatch.chdir(tmp_path)
    theirs = {
        name: p.default
        for name, p in inspect.signature(pl.Trainer.__init__).parameters.items()
        if name != "self"
    }
    assert len(theirs) == 41
    assert set(theirs) - set(inspect.signature(Trainer.__init__).parameters) == set()
    for name, default in theirs.items():
        Trainer(**{name: default})
    trainer = Trainer(**theirs)
    assert (trainer.max_steps, trainer.precision, trainer.num_sanity_val_steps) == (None, "32-true", 2)
    assert (trainer.overfit_batches, trainer.inference_mode, trainer.use_distributed_sampler) == (
        0.0,
        True,
        True,
    )


@pytest.mark.parametrize(
    "limits, steps",
    [
        ({}, 4),  # EarlyStopping stops after epoch 1 (2 steps an epoch)
        ({"min_steps": 7}, 7),  # on until step 7, inside epoch 3
        ({"min_epochs": 3}, 6),
        ({"min_epochs": 5, "max_epochs": 3}, 6),  # max_epochs still bounds it
        ({"min_steps": 20, "max_steps": 5}, 5),
    ],
)
def test_min_steps_and_min_epochs_hold_early_stopping_back_as_in_lightning(tmp_path, limits, steps):
    ran = {}
    for framework in FRAMEWORKS:
        _, base, _, early_stopping = api(framework)
        # patience=0 (Lightning allows it): stop at the first check without improvement
        stopper = early_stopping(monitor="score", patience=0)
        kwargs = {"max_epochs": 10, "callbacks": [stopper], **limits}
        ran[framework] = fit(
            framework, tmp_path, recorder(base)(), loader(8), loader(4), **kwargs
        ).global_step
    assert ran == {"lightning": steps, "trainer": steps}


def test_min_steps_alone_also_asks_for_one_whole_epoch_as_in_lightning(tmp_path):
    ran = {}
    for framework in FRAMEWORKS:
        _, base, callback, _ = api(framework)

        class StopAtOnce(callback):
            def on_train_batch_end(self, trainer, *args):
                trainer.should_stop = True

        module = recorder(base)()
        trainer = fit(
            framework, tmp_path, module, loader(12), max_epochs=5, min_steps=1, callbacks=[StopAtOnce()]
        )
        ran[framework] = trainer.global_step
    assert ran == {"lightning": 3, "trainer": 3}  # the first epoch's 3 steps


@pytest.mark.parametrize("overfit", [2, 0.25])
def test_overfit_batches_takes_the_same_first_batches_unshuffled_every_epoch_as_lightning(tmp_path, overfit):
    seen = {}
    for framework in FRAMEWORKS:
        module = recorder(api(framework)[1])()
        train, val = loader(32, shuffle=True), loader(32, first=100, shuffle=True)
        fit(framework, tmp_path, module, train, val, max_epochs=3, overfit_batches=overfit)
        seen[framework] = {"train": module.train_batches, "val": module.val_batches}
    assert seen["trainer"] == seen["lightning"]
    # the first 2 of 8 batches, in order, each epoch; Lightning 2.6 validates on the val loader's first ones
    assert seen["trainer"]["train"] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 3
    assert (
        seen["trainer"]["val"] == [[100, 101, 102, 103], [104, 105, 106, 107]] * 4
    )  # the sanity check, 3 epochs


@pytest.mark.parametrize("every", [0, 1, 2])
def test_reload_dataloaders_every_n_epochs_calls_the_loader_methods_as_lightning(tmp_path, every):
    seen = {}
    for framework in FRAMEWORKS:

        class Reloading(recorder(api(framework)[1])):
            """Its own loaders, each call's samples numbered from 100 x the call's count."""

            calls = Counter()

            def train_dataloader(self):
                self.calls["train"] += 1
                return loader(8, first=100 * self.calls["train"])

            def val_dataloader(self):
                self.calls["val"] += 1
                return loader(4, first=1000 + 100 * self.calls["val"])

        module = Reloading()
        fit(framework, tmp_path, module, max_epochs=5, reload_dataloaders_every_n_epochs=every)
        seen[framework] = (dict(module.calls), module.train_batches, module.val_batches)
    assert seen["trainer"] == seen["lightning"]
    assert seen["trainer"][0]["train"] == {0: 1, 1: 5, 2: 3}[every]


def test_detect_anomaly_raises_on_a_backward_that_returns_nan_as_lightning(tmp_path):
    for framework in FRAMEWORKS:

        class NaNBackward(recorder(api(framework)[1])):
            def training_step(self, batch, batch_idx):
                # sqrt's gradient at 0 is inf, and inf x 0 is NaN in the multiplication's backward
                return (self.layer(batch[0]) * 0).sqrt().sum()

        with pytest.raises(RuntimeError, match="Function 'MulBackward0' returned nan values"):
            fit(framework, tmp_path, NaNBackward(), loader(8), max_steps=1, detect_anomaly=True)
    assert not torch.is_anomaly_enabled()  # put back after the stage


@pytest.mark.parametrize("inference_mode", [True, False])
def test_inference_mode_evaluates_under_torch_inference_mode_as_lightning(tmp_path, inference_mode):
    modes = {}
    for framework in FRAMEWORKS:
        module = recorder(api(framework)[1])()
        trainer = fit(
            framework, tmp_path, module, loader(8), loader(4), max_epochs=1, inference_mode=inference_mode
        )
        trainer.validate(module, loader(4))
        trainer.predict(module, loader(4))
        modes[framework] = module.modes
    assert modes["trainer"] == modes["lightning"]
    # a fit's validations (the sanity check, the epoch's end) under no_grad, as Lightning's
    assert modes["trainer"] == [("validation", False)] * 2 + [
        ("validation", inference_mode),
        ("predict", inference_mode),
    ]


@pytest.mark.parametrize(
    "flags",
    [{"benchmark": True}, {"benchmark": False}, {"deterministic": True}, {"deterministic": "warn"}],
    ids=["benchmark", "no-benchmark", "deterministic", "deterministic-warn"],
)
def test_benchmark_and_deterministic_set_torch_in_the_steps_as_lightning_and_are_put_back(tmp_path, flags):
    torch.backends.cudnn.benchmark = not flags.get("benchmark", True)
    before = (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled())
    switches = {}
    try:
        for framework in FRAMEWORKS:
            module = recorder(api(framework)[1])()
            fit(framework, tmp_path, module, loader(8), max_steps=2, **flags)
            switches[framework] = module.switches
            assert (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled()) == before
    finally:
        torch.backends.cudnn.benchmark = False
    assert switches["trainer"] == switches["lightning"]


def test_check_val_every_n_epoch_none_validates_every_val_check_interval_steps_across_epochs(tmp_path):
    seen = {}
    for framework in FRAMEWORKS:
        module = recorder(api(framework)[1])()
        kwargs = {"max_steps": 6, "val_check_interval": 3, "check_val_every_n_epoch": None}
        fit(framework, tmp_path, module, loader(8), loader(4), num_sanity_val_steps=0, **kwargs)
        seen[framework] = len(module.val_batches)
    assert seen == {"lightning": 2, "trainer": 2}  # after steps 3 and 6, over epochs of 2 steps


def test_max_steps_minus_one_and_max_epochs_minus_one_mean_no_limit_as_in_lightning(tmp_path):
    steps = {}
    for framework in FRAMEWORKS:
        module = recorder(api(framework)[1])()
        steps[framework] = [
            fit(framework, tmp_path, module, loader(8), max_steps=5, max_epochs=-1).global_step,
            fit(framework, tmp_path, module, loader(8), max_steps=-1, max_epochs=2).global_step,
        ]
    assert steps == {"lightning": [5, 4], "trainer": [5, 4]}


@pytest.mark.parametrize(
    "name",
    [
        "ddp_find_unused_parameters_true",
        "ddp_find_unused_parameters_false",
        "ddp_spawn",
        "ddp_spawn_find_unused_parameters_true",
        "ddp_fork",
        "ddp_notebook_find_unused_parameters_false",
    ],
)
def test_lightnings_ddp_strategy_names_are_ddp_with_their_find_unused_parameters(name):
    from pytorch_lightning.strategies import StrategyRegistry

    strategy = build_strategy(name, processes=2)
    assert type(strategy) is DDPStrategy
    theirs = StrategyRegistry[name]["init_params"].get("find_unused_parameters", False)
    assert strategy.options.ddp_kwargs["find_unused_parameters"] is theirs
    assert type(Trainer(strategy=name, accelerator="cpu", devices=2).strategy) is DDPStrategy


@pytest.mark.parametrize(
    "conflict",
    [
        {"enable_checkpointing": True},
        {"logger": True},
        {"enable_progress_bar": True},
        {"log_every_n_steps": 5},
        {"enable_model_summary": True},
        {"num_sanity_val_steps": 2},
        {"fast_dev_run": True},
        {"detect_anomaly": True},
        {"profiler": "simple"},
    ],
    ids=lambda kwargs: next(iter(kwargs)),
)
def test_barebones_refuses_what_it_turns_off_as_lightning(conflict):
    import pytorch_lightning as pl

    name, value = next(iter(conflict.items()))
    with pytest.raises(ValueError, match="barebones=True"):
        pl.Trainer(barebones=True, **conflict)
    with pytest.raises(
        ValueError, match=rf"barebones=True with {name}={value!r}: .* is off in barebones mode"
    ):
        Trainer(barebones=True, **conflict)


def test_barebones_runs_without_checkpoints_loggers_summary_or_sanity_check(tmp_path):
    module = recorder(TrainModule)()
    trainer = Trainer(barebones=True, max_steps=2, default_root_dir=tmp_path)
    trainer.fit(module, loader(8), loader(4))
    assert trainer.barebones and trainer.checkpoint_callback is None
    assert [type(lg).__name__ for lg in trainer.loggers] == ["JSONLLogger"]  # the run log stays
    assert not (tmp_path / "checkpoints").exists()
    assert (trainer.num_sanity_val_steps, trainer.enable_progress_bar, trainer.enable_model_summary) == (
        0,
        False,
        False,
    )
    assert len(module.val_batches) == 1  # the validation at the fit's end only: no sanity check


def test_plugins_with_a_counterpart_here_are_taken_and_the_others_refused_by_name():
    from lightning_fabric.plugins.environments import SLURMEnvironment
    from pytorch_lightning.plugins import (
        DoublePrecision,
        MixedPrecision,
        TorchCheckpointIO,
        TorchSyncBatchNorm,
    )

    assert Trainer(plugins=[MixedPrecision("bf16-mixed", "cpu")]).precision == "bf16-mixed"
    assert Trainer(plugins=TorchSyncBatchNorm()).sync_batchnorm
    assert Trainer(plugins=[SLURMEnvironment()]).precision == "32-true"
    with pytest.raises(ValueError, match=r"plugins=\[TorchCheckpointIO\] has no counterpart here; allowed: "):
        Trainer(plugins=[TorchCheckpointIO()])
    with pytest.raises(ValueError, match=r"precision='64-true' is unknown"):
        Trainer(plugins=[DoublePrecision()])
    with pytest.raises(ValueError, match=r"precision='16-mixed' and plugins=\[MixedPrecision"):
        Trainer(precision="16-mixed", plugins=[MixedPrecision("bf16-mixed", "cpu")])


def test_profiler_names_stand_for_this_projects_profilers(tmp_path):
    simple = Trainer(profiler="simple", max_steps=2, default_root_dir=tmp_path, **QUIET)
    (times,) = [cb for cb in simple.callbacks if isinstance(cb, PhaseTimes)]
    simple.fit(recorder(TrainModule)(), loader(8))
    assert times.steps == 2 and times.seconds["forward"] > 0 and times.seconds["backward"] > 0
    (torch_profiler,) = [cb for cb in Trainer(profiler="pytorch").callbacks if isinstance(cb, Profiler)]
    assert not torch_profiler.with_stack
    (advanced,) = [cb for cb in Trainer(profiler="advanced").callbacks if isinstance(cb, Profiler)]
    assert advanced.with_stack and advanced.record_shapes
    own = Profiler(active=1)
    assert own in Trainer(profiler=own).callbacks
    with pytest.raises(
        ValueError, match=r"profiler='xla' is unknown; allowed: 'simple', 'advanced', 'pytorch'"
    ):
        Trainer(profiler="xla")


def test_enable_autolog_hparams_false_gives_the_loggers_no_hyperparameters(tmp_path):
    class Recording(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.hparams: list[dict] = []

        def log_hyperparams(self, params) -> None:
            self.hparams.append(dict(params))

        def log_metrics(self, metrics, step=None) -> None:
            pass

    class WithHparams(recorder(TrainModule)):
        def __init__(self, width: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters()

    for autolog, expected in ((True, [{"width": 3}]), (False, [])):
        logger = Recording()
        trainer = Trainer(
            logger=logger, enable_autolog_hparams=autolog, max_steps=1, default_root_dir=tmp_path
        )
        trainer.fit(WithHparams(), loader(4))
        assert logger.hparams == expected


def test_model_registry_and_a_single_callback_are_taken_as_lightning_takes_them(caplog):
    stopper = EarlyStopping()
    trainer = Trainer(model_registry="my-model:v3", callbacks=stopper)
    assert trainer.model_registry == "my-model" and stopper in trainer.callbacks
    assert "uploads and downloads nothing" in caplog.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"overfit_batches": -1},
            r"overfit_batches=-1 is invalid; allowed: 0 \(off\), an int >= 1 or a float",
        ),
        ({"min_steps": -2}, r"min_steps=-2 is invalid; allowed: an int >= 0 or None"),
        ({"min_epochs": 1.5}, r"min_epochs=1.5 is invalid; allowed: an int >= 0 or None"),
        ({"deterministic": "yes"}, r"deterministic='yes' is invalid; allowed: True, False, 'warn' or None"),
        ({"benchmark": "x"}, r"benchmark='x' is invalid; allowed: True, False or None"),
        ({"reload_dataloaders_every_n_epochs": -1}, r"reload_dataloaders_every_n_epochs=-1 is invalid"),
        (
            {"check_val_every_n_epoch": None},
            r"check_val_every_n_epoch=None validates every val_check_interval",
        ),
    ],
)
def test_bad_values_of_the_new_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Trainer(**kwargs)


def test_use_distributed_sampler_false_is_refused_where_the_split_is_not_the_users():
    with pytest.raises(
        ValueError, match=r"use_distributed_sampler=False with DPSGDStrategy, which samples its own"
    ):
        Trainer(strategy=DPSGDStrategy(noise_multiplier=1.0), use_distributed_sampler=False)


@pytest.mark.slow
def test_sync_batchnorm_and_use_distributed_sampler_under_two_processes(tmp_path):
    run_ranks(2, SCRIPTS / "trainer_arguments_script.py", str(tmp_path / "runs"), timeout=240)
    ranks = [json.loads((tmp_path / "runs" / f"rank{r}.json").read_text()) for r in range(2)]
    # the reference: one process, BatchNorm over the global batch of 2 x 4 samples a step
    one = BatchNormNet()
    Trainer(default_root_dir=tmp_path / "one", **FIT).fit(one, DataLoader(dataset(), batch_size=8))
    expected = state(one)
    for rank, record in enumerate(ranks):
        plain = record["plain"]
        assert plain["classes_in_fit"][1] == "BatchNorm1d"
        for run in ("sync", "sync_fsdp"):
            sync = record[run]
            assert sync["classes_in_fit"][1] == "CPUSyncBatchNorm", run
            assert sync["classes_after"][1] == "BatchNorm1d", run  # put back after the fit, as Lightning does
            for name, values in expected.items():
                diff = (torch.tensor(sync["state"][name]) - torch.tensor(values)).abs().max().item()
                assert diff < 1e-6, f"{run}, rank {rank}: {name} differs from one process's by {diff:.2e}"
        assert any(  # without it, each rank normalises its half: the test can tell
            (torch.tensor(plain["state"][n]) - torch.tensor(v)).abs().max() > 1e-3
            for n, v in expected.items()
        )
        assert record["unsharded"]["seen"] == [
            [0, 1, 2, 3],
            [4, 5, 6, 7],
            [8, 9, 10, 11],
        ]  # the loader as given
        assert plain["seen"][0] == [rank, rank + 2, rank + 4, rank + 6]  # the default: this rank's share
