"""Trainer arguments whose behaviour was compared only on this project's side, now run side by side with
real PyTorch Lightning 2.6: one module written as Lightning's docs write it, on either base class, the same
seeded weights and data, SGD (every factor on a gradient shows in the weights), `pl.Trainer` and
`trainer.Trainer` with the same arguments on the CPU in this process. What each compares: the final weights
and every micro-batch's loss (clipping, accumulation, bf16), the batch indices every step saw (fast_dev_run,
the sanity check, the limits), the steps a fake clock allows (max_time), the logger's hyperparameters. The
README's differences (logger=True, "16-mixed" on the CPU, max_time after a validation, the default
default_root_dir) are asserted as differences."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers import FakeClock, fake_time, regression_data
from lightning_twins import FRAMEWORKS, assert_same_weights
from lightning_twins import QUIET_RUN as QUIET
from torch import nn
from torch.utils.data import DataLoader

from callbacks import Callback
from trainer import Trainer, TrainModule
from trainer.loggers import JSONLLogger, Logger


class Body:
    """The module's body: a two-layer regressor that records each stage's batch_idx (the sanity check's
    apart) and each micro-batch's training loss."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.lr = lr
        self.seen: dict[str, list[int]] = {"train": [], "sanity": [], "val": [], "test": [], "predict": []}
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.layer(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.seen["train"].append(batch_idx)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["sanity" if self.trainer.sanity_checking else "val"].append(batch_idx)
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["test"].append(batch_idx)
        self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["predict"].append(batch_idx)
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LitBody(Body, pl.LightningModule):
    pass


class OurBody(Body, TrainModule):
    pass


def module(framework: str, **kwargs: Any) -> Body:
    return (LitBody if framework == "lightning" else OurBody)(**kwargs)


def data(n: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    return DataLoader(regression_data(n, seed=seed), batch_size=batch_size)


def make_trainer(framework: str, root: Path, **kwargs: Any) -> pl.Trainer | Trainer:
    """`framework`'s Trainer with QUIET and `kwargs` (ours without its own seed: the test seeds)."""
    flags = {**QUIET, **kwargs}
    if framework == "lightning":
        return pl.Trainer(default_root_dir=root / framework, **flags)
    return Trainer(default_root_dir=root / framework, seed=None, **flags)


def fit_both(root: Path, module_kwargs: dict | None = None, loaders=None, **kwargs: Any) -> dict[str, tuple]:
    """{framework: (module, trainer)} after each fits its twin on the same loaders (default: 8 train
    batches, 4 val batches)."""
    runs = {}
    for framework in FRAMEWORKS:
        net = module(framework, **(module_kwargs or {}))
        trainer = make_trainer(framework, root, **kwargs)
        trainer.fit(net, *(loaders() if loaders else (data(64), data(32, seed=1))))
        runs[framework] = (net, trainer)
    return runs


def furthest(a: nn.Module, b: nn.Module) -> float:
    """The largest difference between the two modules' parameters."""
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


# -- gradient_clip_val, gradient_clip_algorithm, accumulate_grad_batches ------------------------------


@pytest.mark.parametrize(
    "clip",
    [
        {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"},
        {"gradient_clip_val": 0.004, "gradient_clip_algorithm": "value"},
        {},
    ],
    ids=["norm", "value", "none"],
)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_clipping_and_accumulation_give_lightnings_losses_and_weights(tmp_path, clip, accumulate):
    runs = fit_both(tmp_path, {"lr": 0.5}, max_epochs=2, accumulate_grad_batches=accumulate, **clip)
    (theirs, lit_trainer), (ours, our_trainer) = runs["lightning"], runs["trainer"]
    assert our_trainer.global_step == lit_trainer.global_step == 16 // accumulate
    assert ours.seen == theirs.seen
    assert ours.losses == pytest.approx(theirs.losses, abs=1e-6)
    assert_same_weights(theirs, ours, atol=1e-6)
    if clip:  # the threshold bites: Lightning without it ends elsewhere
        unclipped = LitBody(lr=0.5)
        make_trainer(
            "lightning", tmp_path / "unclipped", max_epochs=2, accumulate_grad_batches=accumulate
        ).fit(unclipped, data(64), data(32, seed=1))
        assert furthest(unclipped, theirs) > 1e-3


class HeadOnly:
    """Trains only its head: `layer` is left out of the optimizer but keeps requires_grad, so its gradients
    pile up step after step until the module's `on_validation_model_zero_grad` frees them before each
    validation; a norm taken over the whole module would be dominated by them."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=self.lr)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_covers_the_optimizers_parameters_and_validation_frees_gradients_as_lightning(
    tmp_path, algorithm
):
    runs, piled = {}, {}
    for framework in FRAMEWORKS:
        net = type("Net", (HeadOnly, LitBody if framework == "lightning" else OurBody), {})(lr=0.5)
        trainer = make_trainer(
            framework, tmp_path, max_epochs=2, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm
        )
        before = []  # the layer's piled-up gradient as each validation starts
        net.on_validation_model_eval = lambda net=net, before=before: before.append(net.layer.weight.grad)
        trainer.fit(net, data(64), data(32, seed=1))
        runs[framework], piled[framework] = net, before
    theirs, ours = runs["lightning"], runs["trainer"]
    assert ours.losses == pytest.approx(theirs.losses, abs=1e-6)
    assert_same_weights(theirs, ours, atol=1e-6)
    # freed before each validation (the sanity check's apart), unclipped in between, as under Lightning
    assert (
        [g is None for g in piled["trainer"]] == [g is None for g in piled["lightning"]] == [True, True, True]
    )
    assert ours.layer.weight.grad is None and theirs.layer.weight.grad is None


class ReadsNorms:
    """Reads the gradient norm in on_before_optimizer_step, where Lightning's docs track it."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])
        self.__dict__.setdefault("norms", []).append(norm.item())


def test_on_before_optimizer_step_sees_the_gradients_before_clipping_as_lightnings(tmp_path):
    runs = {}
    for framework in FRAMEWORKS:
        net = type("Net", (ReadsNorms, LitBody if framework == "lightning" else OurBody), {})(lr=0.5)
        make_trainer(framework, tmp_path, max_epochs=1, gradient_clip_val=0.05).fit(net, data(64))
        runs[framework] = net
    theirs, ours = runs["lightning"], runs["trainer"]
    assert len(ours.norms) == 8 and ours.norms == pytest.approx(theirs.norms, rel=1e-6)
    assert min(ours.norms) > 0.05  # unclipped: every step's norm is above the threshold
    assert_same_weights(theirs, ours, atol=1e-6)


# -- fast_dev_run -----------------------------------------------------------------------------------


def all_stages(framework: str, root: Path, **kwargs: Any) -> tuple[Body, pl.Trainer | Trainer]:
    """fit (8 train, 4 val batches), then validate, test and predict (4 batches each) with one Trainer."""
    net = module(framework)
    trainer = make_trainer(framework, root, **kwargs)
    trainer.fit(net, data(64), data(32, seed=1))
    trainer.validate(net, data(32, seed=1))
    trainer.test(net, data(32, seed=2))
    trainer.predict(net, data(32, seed=2))
    return net, trainer


def checkpoints(root: Path) -> list[str]:
    """Every file under `root` of a checkpoint: Lightning's `.ckpt` files, the files of our directories."""
    return [str(p) for p in root.rglob("*") if p.is_file() and ("ckpt" in p.name or "checkpoint" in str(p))]


@pytest.mark.parametrize("fast_dev_run", [True, 3])
def test_fast_dev_run_runs_lightnings_batches_and_writes_no_checkpoint(tmp_path, fast_dev_run):
    seen, steps = {}, {}
    for framework in FRAMEWORKS:
        kwargs = {"fast_dev_run": fast_dev_run, "max_epochs": 5, "enable_checkpointing": True}
        net, trainer = all_stages(framework, tmp_path, **kwargs)
        seen[framework], steps[framework] = net.seen, trainer.global_step
        assert checkpoints(tmp_path / framework) == [], framework
    n = 1 if fast_dev_run is True else fast_dev_run
    assert steps == {"lightning": n, "trainer": n}
    assert seen["trainer"] == seen["lightning"]
    # no sanity check: the fit's validation, then validate's; n batches of each loop
    batches = list(range(n))
    expected = {"train": batches, "sanity": [], "val": batches * 2, "test": batches, "predict": batches}
    assert seen["trainer"] == expected


# -- num_sanity_val_steps, limit_train/val/test/predict_batches ----------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_sanity_val_steps": 0},
        {"num_sanity_val_steps": 1},
        {"num_sanity_val_steps": -1},
        {"num_sanity_val_steps": 9},  # more than the loader's 4 batches
        {"num_sanity_val_steps": -1, "limit_val_batches": 2},
        {
            "limit_train_batches": 3,
            "limit_val_batches": 2,
            "limit_test_batches": 1,
            "limit_predict_batches": 3,
        },
        {
            "limit_train_batches": 0.3,
            "limit_val_batches": 0.5,
            "limit_test_batches": 0.75,
            "limit_predict_batches": 0.3,
        },
        {"limit_train_batches": 1.0, "limit_val_batches": 0},
    ],
    ids=lambda kwargs: "-".join(
        f"{k.split('_')[-2] if k.startswith('limit') else 'sanity'}={v}" for k, v in kwargs.items()
    ),
)
def test_sanity_steps_and_limits_run_lightnings_batches(tmp_path, kwargs):
    seen, steps = {}, {}
    for framework in FRAMEWORKS:
        net, trainer = all_stages(framework, tmp_path, max_epochs=2, **kwargs)
        seen[framework], steps[framework] = net.seen, trainer.global_step
    assert seen["trainer"] == seen["lightning"]
    assert steps["trainer"] == steps["lightning"]


@pytest.mark.parametrize("limit", [0, 0.0])
def test_limit_train_batches_zero_skips_training_as_lightning(tmp_path, limit):
    """Lightning's fit with limit_train_batches=0: the sanity check, no training hooks nor steps, no
    checkpoint; validate, test and predict after it as usual. (This Trainer refused it.)"""
    seen, hooks = {}, {}
    for framework in FRAMEWORKS:

        class Hooks(pl.Callback if framework == "lightning" else Callback):
            def __init__(self) -> None:
                self.calls: list[str] = []

            def on_train_start(self, *args: Any) -> None:
                self.calls.append("on_train_start")

            def on_train_end(self, *args: Any) -> None:
                self.calls.append("on_train_end")

            def on_fit_end(self, *args: Any) -> None:
                self.calls.append("on_fit_end")

        recorder = Hooks()
        kwargs = {"limit_train_batches": limit, "enable_checkpointing": True, "callbacks": [recorder]}
        net, trainer = all_stages(framework, tmp_path, max_epochs=2, **kwargs)
        seen[framework], hooks[framework] = (net.seen, trainer.global_step), recorder.calls
        assert checkpoints(tmp_path / framework) == [], framework
    assert seen["trainer"] == seen["lightning"]
    assert hooks["trainer"] == hooks["lightning"] == ["on_fit_end"]
    assert seen["trainer"][0]["sanity"] == [0, 1] and seen["trainer"][0]["train"] == []


# -- precision ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_on_the_cpu_gives_lightnings_losses_and_weights(tmp_path, precision):
    runs = fit_both(tmp_path, {"lr": 0.5}, max_epochs=2, precision=precision)
    (theirs, _), (ours, our_trainer) = runs["lightning"], runs["trainer"]
    assert our_trainer.precision == precision
    # the same ops in the same dtypes (torch.autocast("cpu", torch.bfloat16), or bf16 weights and inputs):
    # the same arithmetic, so fp32's tolerance, 1e-6; bf16's own rounding (8 bits of mantissa) moves these
    # losses by ~1e-2, four orders more, which the last line checks
    assert ours.losses == pytest.approx(theirs.losses, abs=1e-6)
    assert_same_weights(theirs, ours, atol=1e-6)
    full = LitBody(lr=0.5)
    make_trainer("lightning", tmp_path / "32", max_epochs=2).fit(full, data(64), data(32, seed=1))
    assert max(abs(a - b) for a, b in zip(full.losses, theirs.losses, strict=True)) > 1e-3


def test_16_mixed_on_the_cpu_is_fp16_here_and_lightnings_bf16_mixed(tmp_path):
    # a README difference: Lightning turns "16-mixed" on the CPU into "bf16-mixed" (with a warning); here it
    # stays fp16 autocast with a gradient scaler, so our "bf16-mixed" is what Lightning runs
    runs = {}
    for framework, precision in (("lightning", "16-mixed"), ("trainer", "bf16-mixed"), ("fp16", "16-mixed")):
        net = module("trainer" if framework == "fp16" else framework, lr=0.5)
        trainer = make_trainer(
            "trainer" if framework == "fp16" else framework,
            tmp_path / framework,
            max_epochs=2,
            precision=precision,
        )
        trainer.fit(net, data(64), data(32, seed=1))
        runs[framework] = (net, trainer.precision)
    assert [runs[f][1] for f in runs] == ["bf16-mixed", "bf16-mixed", "16-mixed"]
    assert runs["trainer"][0].losses == pytest.approx(runs["lightning"][0].losses, abs=1e-6)
    assert (
        max(abs(a - b) for a, b in zip(runs["fp16"][0].losses, runs["lightning"][0].losses, strict=True))
        > 1e-3
    )


# -- max_time ----------------------------------------------------------------------------------------


def timed_fit(framework: str, root: Path, monkeypatch, max_time: Any) -> Body:
    """A fit of 4 batches an epoch whose training steps take 2 s and validation batches 1 s of one fake
    clock, read by Lightning's Timer (time.monotonic) and by this Trainer's fit loop (time.time)."""
    clock = FakeClock()
    fake_time(monkeypatch, "pytorch_lightning.callbacks.timer", clock, "monotonic")
    for name in ("trainer.loop.fit_loop", "trainer.loop.stopping"):
        fake_time(monkeypatch, name, clock, "time")

    class Timed(LitBody if framework == "lightning" else OurBody):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            clock.advance(2.0)
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            clock.advance(1.0)
            super().validation_step(batch, batch_idx)

    net = Timed()
    trainer = make_trainer(framework, root, max_epochs=10, limit_train_batches=4, max_time=max_time)
    trainer.fit(net, data(64), data(32, seed=1))
    monkeypatch.undo()
    return net


@pytest.mark.parametrize(
    "max_time, steps",
    [
        ("00:00:00:05", 3),  # 6 s after step 3
        ({"seconds": 16}, 6),  # epoch 1: 4 steps and its validation, 12 s; steps 5 and 6 reach 16 s
        (datetime.timedelta(seconds=17), 7),
    ],
    ids=["str", "dict", "timedelta"],
)
def test_max_time_stops_after_lightnings_steps_on_a_shared_fake_clock(tmp_path, monkeypatch, max_time, steps):
    theirs = timed_fit("lightning", tmp_path, monkeypatch, max_time)
    ours = timed_fit("trainer", tmp_path, monkeypatch, max_time)
    assert len(theirs.seen["train"]) == steps
    assert ours.seen == theirs.seen  # the same steps, the sanity check and validations (one at the stop)


def test_max_time_used_up_by_a_validation_stops_before_the_step_lightning_still_takes(tmp_path, monkeypatch):
    # 20 s after epoch 2's last step, 24 s after its validation. Lightning's Timer reads the clock at each
    # train batch's end, before that batch's validation, so it trains step 9 (26 s) and validates again;
    # this Trainer reads it before each step, so the validation's time counts there: it stops at 8
    theirs = timed_fit("lightning", tmp_path, monkeypatch, "00:00:00:23")
    ours = timed_fit("trainer", tmp_path, monkeypatch, "00:00:00:23")
    assert len(theirs.seen["train"]) == 9 and ours.seen["train"] == theirs.seen["train"][:8]


# -- enable_autolog_hparams, logger --------------------------------------------------------------------


def recording_logger(base: type) -> Logger | pl.loggers.Logger:
    """A logger on `base` (Lightning's or ours) that keeps every log_hyperparams call's keys."""

    class Recording(base):
        def __init__(self) -> None:
            super().__init__()
            self.hparams: list[list[str]] = []

        @property
        def name(self) -> str:
            return "recording"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            self.hparams.append(sorted(dict(vars(params) if not isinstance(params, dict) else params)))

        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            pass

    return Recording()


@pytest.mark.parametrize("autolog", [True, False])
def test_enable_autolog_hparams_gives_the_logger_lightnings_hyperparameters(tmp_path, autolog):
    logged = {}
    for framework in FRAMEWORKS:

        class WithHparams(LitBody if framework == "lightning" else OurBody):
            def __init__(self, lr: float = 0.1, width: int = 16, name: str = "net") -> None:
                super().__init__(lr)
                self.save_hyperparameters()

        logger = recording_logger(pl.loggers.Logger if framework == "lightning" else Logger)
        trainer = make_trainer(
            framework, tmp_path, max_steps=2, logger=logger, enable_autolog_hparams=autolog
        )
        trainer.fit(WithHparams(width=4), data(64))
        logged[framework] = logger.hparams
    assert logged["trainer"] == logged["lightning"]
    assert logged["trainer"] == ([["lr", "name", "width"]] if autolog else [])


@pytest.mark.parametrize("logger", [True, None], ids=["True", "default"])
def test_logger_true_or_unset_is_the_jsonl_log_here_and_lightnings_tensorboard_logger(tmp_path, logger):
    # a README difference: Lightning's default logger is a TensorBoardLogger (a CSVLogger without
    # tensorboard); this Trainer's is its always-on JSONL log, and TensorBoard is one to pass
    kwargs = {} if logger is None else {"logger": logger}
    theirs = pl.Trainer(default_root_dir=tmp_path / "lightning", **kwargs)
    ours = Trainer(default_root_dir=tmp_path / "trainer", **kwargs)
    assert [type(lg).__name__ for lg in theirs.loggers] == ["TensorBoardLogger"]
    assert [type(lg) for lg in ours.loggers] == [JSONLLogger]


def test_default_root_dir_unset_is_runs_here_and_the_working_directory_under_lightning(tmp_path, monkeypatch):
    # a README difference: this Trainer's runs go under ./runs; Lightning's under the working directory
    monkeypatch.chdir(tmp_path)
    assert pl.Trainer(logger=False).default_root_dir == str(tmp_path)
    assert Path(Trainer().default_root_dir).resolve() == tmp_path / "runs"
