"""Lightning's weight averaging, fine-tuning and tuner callbacks run on PyTorch Lightning and here on the same
tiny module (its code mixed into LightningModule or TrainModule, the same seed, SGD, unshuffled data): the
averaged weights, the LR of every step, the param groups and what requires grad per epoch, the LR finder's
curve and suggestion, the batch size found, and that the tuners leave the model and optimizer as they were."""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers import StopAt
from pytorch_lightning import callbacks as plc
from pytorch_lightning.tuner import Tuner as LightningTuner
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import callbacks as ours
from trainer import DataModule, Trainer, TrainModule
from trainer.tuner import Tuner

FRAMEWORKS = ("lightning", "ours")
CALLBACKS = {"lightning": plc, "ours": ours}


def data(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=g)
    return TensorDataset(x, torch.tanh(x @ torch.randn(4, 1, generator=g)))


class Body:
    """The module's code, the same under both frameworks: a `backbone` and a `head`, what each training step
    saw (batch size, the LR of every param group), validation losses and, per epoch, the param groups and
    which parameters require grad. `oom_above`: a batch larger than that runs out of memory (simulated)."""

    def __init__(self, batch_norm=False, lr=0.1, batch_size=8, momentum=0.0, samples=64, oom_above=None):
        super().__init__()
        torch.manual_seed(0)
        norm = [nn.BatchNorm1d(8)] if batch_norm else []
        self.backbone = nn.Sequential(nn.Linear(4, 8), *norm, nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.lr, self.batch_size, self.momentum = lr, batch_size, momentum
        self.samples, self.oom_above = samples, oom_above
        self.seen, self.lrs, self.val_losses, self.epochs = [], [], [], []

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(len(x))
        if self.oom_above is not None and len(x) > self.oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        self.lrs.append([group["lr"] for group in self.optimizers().param_groups])
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        self.val_losses.append(F.mse_loss(self(batch[0]), batch[1]).item())

    def on_train_epoch_end(self):
        groups = self.optimizers().param_groups
        trainable = [name for name, p in self.named_parameters() if p.requires_grad]
        self.epochs.append(([len(g["params"]) for g in groups], [g["lr"] for g in groups], trainable))

    def train_dataloader(self):
        return DataLoader(data(self.samples), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(data(16), batch_size=8)

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(trainable, lr=self.lr, momentum=self.momentum)


class LitModule(Body, pl.LightningModule):
    pass


class OurModule(Body, TrainModule):
    pass


def module(framework: str, **kwargs) -> Body:
    return (LitModule if framework == "lightning" else OurModule)(**kwargs)


def trainer(framework: str, tmp_path, callbacks=(), **kwargs):
    common = dict(
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path / framework,
        **{"enable_checkpointing": False, "max_epochs": 4, "limit_val_batches": 0, **kwargs},
    )
    if framework == "lightning":
        return pl.Trainer(accelerator="cpu", devices=1, **common)
    return Trainer(**common)


def fit_both(tmp_path, make_callbacks, module_kwargs=None, **trainer_kwargs) -> dict[str, tuple]:
    """{framework: (trainer, module, callbacks)} after one fit each."""
    runs = {}
    for framework in FRAMEWORKS:
        callbacks = make_callbacks(framework)
        model = module(framework, **(module_kwargs or {}))
        run = trainer(framework, tmp_path, callbacks, **trainer_kwargs)
        run.fit(model)
        runs[framework] = (run, model, callbacks)
    return runs


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def assert_same_state(ours: dict, theirs: dict, atol: float = 1e-6) -> None:
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(
            ours[name], theirs[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def assert_same_lrs(ours: list[list[float]], theirs: list[list[float]]) -> None:
    """Every step's LR per param group, equal to 1e-12."""
    assert [len(row) for row in ours] == [len(row) for row in theirs]
    assert sum(ours, []) == pytest.approx(sum(theirs, []), rel=1e-12)


def assert_same_steps(ours: Body, theirs: Body) -> None:
    assert ours.seen == theirs.seen
    assert_same_lrs(ours.lrs, theirs.lrs)


# ---- StochasticWeightAveraging -----------------------------------------------------------------------------
@pytest.mark.parametrize(("batch_norm", "strategy"), [(False, "cos"), (True, "linear")])
def test_swa_anneals_averages_and_recomputes_batch_norm_as_lightning(tmp_path, batch_norm, strategy):
    """Epochs 2..5 of 5 anneal to swa_lrs and average; the model ends with the average (and, with BatchNorm, the
    statistics of one more pass over the train data with it)."""

    def swa(framework):
        kwargs = dict(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=2, annealing_strategy=strategy)
        return [CALLBACKS[framework].StochasticWeightAveraging(**kwargs)]

    runs = fit_both(tmp_path, swa, dict(batch_norm=batch_norm), max_epochs=5)
    (_, theirs, (lit_swa,)), (_, ours, (callback,)) = runs["lightning"], runs["ours"]
    assert_same_steps(ours, theirs)
    expected = state(theirs)
    # Lightning's extra BatchNorm epoch ends with an optimizer step on the last training step's gradients
    # (its backward and zero_grad are skipped, its step is not): its weights are then the average less that step
    expected.update({name: p.detach() for name, p in lit_swa._average_model.named_parameters()})
    assert_same_state(state(ours), expected)
    assert int(callback.n_averaged) == int(lit_swa.n_averaged) == 4


def test_swa_resumed_from_a_checkpoint_ends_as_an_uninterrupted_run(tmp_path):
    """Its averaged model, count, scheduler and LRs are in the checkpoint: stopped mid-anneal and resumed, the
    run ends with the same averaged weights."""

    def run(root, stop=None, ckpt_path=None):
        callbacks = [ours.StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=3)]
        model = module("ours")
        fit = trainer("ours", root, callbacks + ([StopAt(stop)] if stop else []), enable_checkpointing=True)
        fit.fit(model, ckpt_path=ckpt_path)
        return model

    whole = run(tmp_path / "whole")
    run(tmp_path / "parts", stop=20)
    resumed = run(tmp_path / "parts", ckpt_path="last")
    assert_same_state(state(resumed), state(whole), atol=0)
    assert resumed.lrs == whole.lrs[20:]


# ---- WeightAveraging, EMAWeightAveraging --------------------------------------------------------------------
def epoch_average(base):
    class EpochAverage(base.WeightAveraging):
        def should_update(self, step_idx=None, epoch_idx=None):
            return epoch_idx is not None

    return EpochAverage()


@pytest.mark.parametrize(
    "make",
    [
        lambda cbs: cbs.EMAWeightAveraging(decay=0.9, update_starting_at_step=3),
        lambda cbs: cbs.EMAWeightAveraging(decay=0.5, update_every_n_steps=3, use_buffers=False),
        lambda cbs: cbs.WeightAveraging(),
        epoch_average,
    ],
    ids=["ema", "ema_every_3_params_only", "swa_per_step", "swa_per_epoch"],
)
def test_weight_averaging_validates_and_ends_with_lightnings_average(tmp_path, make):
    runs = fit_both(
        tmp_path,
        lambda fw: [make(CALLBACKS[fw])],
        dict(batch_norm=True),
        max_epochs=3,
        limit_val_batches=None,
    )
    (_, theirs, _), (_, ours, (callback,)) = runs["lightning"], runs["ours"]
    assert_same_steps(ours, theirs)
    # every validation ran with the averaged weights swapped in
    assert ours.val_losses == pytest.approx(theirs.val_losses, abs=1e-6)
    assert_same_state(state(ours), state(theirs))
    assert callback._average_model.module._trainer is None  # the copy left the Trainer behind


def test_ema_resumed_from_a_checkpoint_ends_as_an_uninterrupted_run(tmp_path):
    def run(root, stop=None, ckpt_path=None):
        callbacks = [ours.EMAWeightAveraging(decay=0.8)]
        model = module("ours", batch_norm=True)
        fit = trainer("ours", root, callbacks + ([StopAt(stop)] if stop else []), enable_checkpointing=True)
        fit.fit(model, ckpt_path=ckpt_path)
        return model

    whole = run(tmp_path / "whole")
    run(tmp_path / "parts", stop=13)
    assert_same_state(state(run(tmp_path / "parts", ckpt_path="last")), state(whole), atol=0)


# ---- BaseFinetuning, BackboneFinetuning ---------------------------------------------------------------------
@pytest.mark.parametrize("train_bn", [True, False])
def test_backbone_finetuning_groups_lrs_and_frozen_parameters_match_lightning(tmp_path, train_bn):
    """Frozen until epoch 1, then the backbone trains in a second group from 10% of the LR, doubling each
    epoch up to the head's; the Trainer's own LR schedule leaves the added group's LR to the callback."""

    def finetuning(framework):
        return [CALLBACKS[framework].BackboneFinetuning(unfreeze_backbone_at_epoch=1, train_bn=train_bn)]

    runs = fit_both(tmp_path, finetuning, dict(batch_norm=True, momentum=0.9), max_epochs=5)
    (_, theirs, cb_theirs), (_, ours, cb_ours) = runs["lightning"], runs["ours"]
    assert ours.epochs == theirs.epochs
    assert [len(groups) for groups, _, _ in ours.epochs] == [1, 2, 2, 2, 2]
    assert_same_steps(ours, theirs)
    assert_same_state(state(ours), state(theirs))
    # its record of the groups (by parameter name): the same but for the "initial_lr" of the Trainer's own schedule
    recorded = [
        [(g["params"], g["lr"]) for g in cb[0].state_dict()["internal_optimizer_metadata"][0]]
        for cb in (cb_ours, cb_theirs)
    ]
    assert recorded[0] == recorded[1]
    assert cb_ours[0].previous_backbone_lr == cb_theirs[0].previous_backbone_lr


def test_base_finetuning_helpers_freeze_and_add_a_group_as_lightnings(tmp_path):
    results = {}
    for framework, base in (("lightning", plc.BaseFinetuning), ("ours", ours.BaseFinetuning)):
        model = module(framework, batch_norm=True)
        base.freeze([model.backbone, model.head], train_bn=True)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3)
        base.unfreeze_and_add_param_group(model.head, optimizer, initial_denom_lr=3.0)
        base.make_trainable(model.backbone[0])
        results[framework] = (
            [(len(g["params"]), g["lr"]) for g in optimizer.param_groups],
            [p.requires_grad for p in model.parameters()],
            [len(list(base.filter_params(model, requires_grad=flag))) for flag in (True, False)],
        )
    assert results["ours"] == results["lightning"]


# ---- LearningRateFinder, Tuner.lr_find -----------------------------------------------------------------------
def test_lr_find_curve_suggestion_and_restored_model_match_lightning(tmp_path):
    """An exponential sweep that diverges before its end: the same LRs, smoothed losses, early stop and
    suggestion; the model's weights are as before and its `lr` is the suggestion."""
    results = {}
    for framework, tuner in (("lightning", LightningTuner), ("ours", Tuner)):
        model = module(framework, samples=512, momentum=0.9)
        before = state(model)
        found = tuner(trainer(framework, tmp_path, max_epochs=1)).lr_find(
            model, min_lr=1e-4, max_lr=50.0, num_training=60
        )
        assert_same_state(state(model), before, atol=0)
        results[framework] = (found, model)
    (theirs, lit), (found, model) = results["lightning"], results["ours"]
    assert 20 < len(found.results["lr"]) < 60  # stopped early on the divergence
    assert found.results["lr"] == pytest.approx(theirs.results["lr"], rel=1e-12)
    assert found.results["loss"] == pytest.approx(theirs.results["loss"], abs=1e-6)
    assert found.suggestion() == theirs.suggestion() == model.lr == lit.lr
    assert_same_lrs(model.lrs, lit.lrs)


def snapshot(trainer, module) -> tuple:
    """What the LR finder must put back: the weights, the optimizer's state, the step counter, the RNG."""
    optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
    return state(module), optimizer, trainer.global_step, torch.get_rng_state()


def finder_at_epoch_one(framework):
    """LearningRateFinder at the start of epoch 1 (Lightning's documented subclass), with what it must put back
    recorded before and after the test."""

    class AtEpochOne(CALLBACKS[framework].LearningRateFinder):
        def on_fit_start(self, trainer, pl_module):
            pass

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                self.seen = [snapshot(trainer, pl_module)]
                self.lr_find(trainer, pl_module)
                self.seen.append(snapshot(trainer, pl_module))

    return [AtEpochOne(min_lr=1e-3, max_lr=1.0, num_training_steps=30, early_stop_threshold=None)]


def test_lr_finder_callback_puts_back_what_it_disturbed_and_trains_with_the_suggestion(tmp_path):
    """Run between epochs 0 and 1: weights, momentum buffers, step counter and RNG as before, the param groups'
    LR set to the suggestion, from which the fit trains on (the Trainer's own schedule too)."""
    runs = fit_both(tmp_path, finder_at_epoch_one, dict(momentum=0.9, samples=256), max_epochs=3)
    for framework in FRAMEWORKS:
        _, _, (finder,) = runs[framework]
        (weights, optimizer, step, rng), (weights_after, optimizer_after, step_after, rng_after) = finder.seen
        assert_same_state(weights_after, weights, atol=0)
        assert [g.pop("lr") for g in optimizer_after["param_groups"]] == [finder.optimal_lr.suggestion()]
        for group in optimizer["param_groups"]:
            del group["lr"]
        torch.testing.assert_close(optimizer_after, optimizer, atol=0, rtol=0)
        assert step_after == step == 32
        assert torch.equal(rng_after, rng)
    (_, theirs, (lit_finder,)), (_, ours, (finder,)) = runs["lightning"], runs["ours"]
    found, theirs_found = finder.optimal_lr.results, lit_finder.optimal_lr.results
    assert found["lr"] == pytest.approx(theirs_found["lr"], rel=1e-12)
    assert found["loss"] == pytest.approx(theirs_found["loss"], abs=1e-6)
    assert_same_steps(ours, theirs)
    assert_same_state(state(ours), state(theirs))


# ---- BatchSizeFinder, Tuner.scale_batch_size ---------------------------------------------------------------
def in_hparams(base):
    class InHparams(base):
        """`batch_size` in the hparams only (Lightning's second place to look)."""

        def __init__(self, batch_size=4, oom_above=None):
            super().__init__(samples=256, oom_above=oom_above)
            del self.batch_size
            self.save_hyperparameters("batch_size")

        def train_dataloader(self):
            return DataLoader(data(self.samples), batch_size=self.hparams.batch_size)

    return InHparams


def in_datamodule(base):
    class InDataModule(base):
        """`batch_size` in the datamodule (Lightning's third place to look)."""

        def __init__(self):
            super().__init__()
            self.batch_size = 4

        def train_dataloader(self):
            return DataLoader(data(256), batch_size=self.batch_size)

        def val_dataloader(self):
            return DataLoader(data(16), batch_size=8)

    return InDataModule()


def tunable(framework: str, holder: str) -> tuple[Body, object, callable]:
    """A module whose batches above 40 run out of memory, its datamodule (or None), and where the size is read."""
    lightning = framework == "lightning"
    if holder == "hparams":
        model = in_hparams(LitModule if lightning else OurModule)(oom_above=40)
        return model, None, lambda: model.hparams.batch_size
    model = module(framework, batch_size=4, samples=256, oom_above=40)
    if holder == "attribute":
        return model, None, lambda: model.batch_size
    del model.batch_size
    datamodule = in_datamodule(pl.LightningDataModule if lightning else DataModule)
    return model, datamodule, lambda: datamodule.batch_size


@pytest.fixture
def no_lightning_gc(monkeypatch):
    """Lightning's gc.collect before each trial frees CUDA memory; without CUDA it only costs time."""
    monkeypatch.setattr("pytorch_lightning.tuner.batch_size_scaling.garbage_collection_cuda", lambda: None)


@pytest.mark.usefixtures("no_lightning_gc")
@pytest.mark.parametrize(
    ("mode", "found", "holder"),
    [
        ("power", 32, "attribute"),
        ("binsearch", 38, "attribute"),
        ("power", 32, "hparams"),
        ("binsearch", 38, "datamodule"),
    ],
)
def test_scale_batch_size_finds_lightnings_size_and_restores_the_model(tmp_path, mode, found, holder):
    """Batches above 40 run out of memory: doubling from 2 stops at 32; bisecting finds 40, less 5%. The size is
    set where the module keeps it; the weights and step counter are as before."""
    sizes = {}
    for framework, tuner in (("lightning", LightningTuner), ("ours", Tuner)):
        model, datamodule, size_now = tunable(framework, holder)
        before = state(model)
        run = trainer(framework, tmp_path, max_epochs=1)
        size = tuner(run).scale_batch_size(model, datamodule=datamodule, mode=mode, init_val=2, max_trials=25)
        assert_same_state(state(model), before, atol=0)
        assert run.global_step == 0
        # Lightning's first trial reads the loader of the size before init_val: the trials from the second on
        sizes[framework] = (size, size_now(), model.seen[3:])
    assert sizes["ours"] == sizes["lightning"]
    assert sizes["ours"][0] == found


@pytest.mark.usefixtures("no_lightning_gc")
def test_batch_size_finder_callback_fit_trains_at_the_size_found_as_lightning(tmp_path):
    def finder(framework):
        return [CALLBACKS[framework].BatchSizeFinder(mode="binsearch", steps_per_trial=2, max_trials=10)]

    runs = fit_both(tmp_path, finder, dict(batch_size=4, samples=256, oom_above=40), max_epochs=2)
    (lit_run, theirs, (lit_cb,)), (run, ours, (callback,)) = runs["lightning"], runs["ours"]
    assert callback.optimal_batch_size == lit_cb.optimal_batch_size == ours.batch_size == 38
    steps = run.global_step
    assert steps == lit_run.global_step == 2 * 7
    assert ours.seen[-steps:] == theirs.seen[-steps:] == [38] * 6 + [28] + [38] * 6 + [28]
    assert ours.lrs[-steps:] == theirs.lrs[-steps:]
    assert_same_state(state(ours), state(theirs))


def test_batch_size_finder_refuses_a_train_loader_passed_to_fit(tmp_path):
    model = module("ours", samples=64)
    run = trainer("ours", tmp_path, [ours.BatchSizeFinder()])
    with pytest.raises(ValueError, match="passed to fit"):
        run.fit(model, model.train_dataloader())


def test_the_tuners_callbacks_come_first_as_in_lightning():
    """Lightning moves them to the front: the other callbacks' hooks see the lr or batch size they found."""
    for framework in FRAMEWORKS:
        cbs = CALLBACKS[framework]
        given = [cbs.EarlyStopping(monitor="x"), cbs.LearningRateFinder(), cbs.Timer(), cbs.BatchSizeFinder()]
        run = (pl.Trainer if framework == "lightning" else Trainer)(
            callbacks=given, enable_checkpointing=False
        )
        assert [type(cb).__name__ for cb in run.callbacks][:4] == [
            "LearningRateFinder",
            "BatchSizeFinder",
            "EarlyStopping",
            "Timer",
        ]


def test_the_finders_refuse_manual_optimization_in_one_line(tmp_path):
    model = module("ours", samples=64)
    model.automatic_optimization = False
    with pytest.raises(RuntimeError, match="manual optimization is not tuned by them"):
        Tuner(trainer("ours", tmp_path, max_epochs=1)).lr_find(model, num_training=5)
