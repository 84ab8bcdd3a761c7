"""Lightning's checkpointing API here: `ModelCheckpoint`'s arguments, saving policy and attributes,
`ckpt_path="best"`, `TrainModule.load_from_checkpoint`, `trainer.save_checkpoint("example.ckpt")` and the
full weights after fit. tests/scripts/lightning_checkpoint_script.py runs Lightning's documented
LitAutoEncoder (top-2 checkpoints, EarlyStopping, LearningRateMonitor, a CSVLogger, a StepLR) on PyTorch
Lightning and here with only the imports changed: the same checkpoints kept (by name), the same best score,
epoch stopped at, CSV values, test results, loaded weights, predictions and final weights, on 1 and (slow)
2 processes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, quiet, regression_loader, run_ranks

from callbacks import ModelCheckpoint
from trainer import Trainer, TrainModule
from trainer import checkpoint as ckpt

SCRIPT = SCRIPTS / "lightning_checkpoint_script.py"


class Lit(TrainModule):
    """A Lightning-style module: hparams saved, `val_loss` logged in `validation_step`."""

    def __init__(self, hidden: int = 8, lr: float = 0.05, act: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, hidden), act or torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def fit(root: Path, epochs: int, *callbacks, **flags) -> tuple[Trainer, Lit]:
    module = Lit()
    trainer = Trainer(
        max_epochs=epochs, seed=0, default_root_dir=root, callbacks=list(callbacks), **quiet(**flags)
    )
    trainer.fit(module, regression_loader(n=64), regression_loader(n=32))
    return trainer, module


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("."))


# ---- side by side with PyTorch Lightning -------------------------------------------------------------
def run_both(tmp_path: Path, devices: int, strategy: str | None = None) -> dict[str, list[dict]]:
    """{framework: [rank 0's record, rank 1's, ...]}; with `strategy`, this project only."""
    results = {}
    for framework in ("lightning", "trainer") if strategy is None else ("trainer",):
        out = tmp_path / framework
        run_ranks(devices, SCRIPT, framework, str(out), *([strategy] if strategy else []), timeout=300)
        results[framework] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]
    return results


def assert_same_checkpoints(lightning: dict, here: dict) -> None:
    assert here["val_losses"] == pytest.approx(lightning["val_losses"], abs=1e-6)
    assert here["stopped_epoch"] == lightning["stopped_epoch"]  # early stopping stopped at the same epoch
    for column in ("val_loss", "lr"):  # the CSV logger's values (rows and the step column are laid out apart)
        assert here["csv"][column] == pytest.approx(lightning["csv"][column], abs=1e-6), column
    assert here["best_k_models"].keys() == lightning["best_k_models"].keys()  # the same epochs, same names
    assert here["best_k_models"] == pytest.approx(lightning["best_k_models"], abs=1e-6)
    for key in ("best_model_path", "kth_best_model_path"):
        assert here[key] == lightning[key], key
    assert here["best_model_score"] == pytest.approx(lightning["best_model_score"], abs=1e-6)
    (tested,) = lightning["test"]  # Lightning: a dict per loader
    assert here["test"] == pytest.approx(tested, abs=1e-6)
    assert here["loaded_hparams"] == lightning["loaded_hparams"]
    for kind in ("loaded_weights", "final_weights"):
        for name, value in lightning[kind].items():
            assert here[kind][name] == pytest.approx(value, abs=1e-6), f"{kind} {name}"
    flat = [torch.tensor(run["predict"]).flatten().tolist() for run in (lightning, here)]
    assert flat[1] == pytest.approx(flat[0], abs=1e-6)  # the predictions of the loaded best
    # the one-call full weights are those of the best checkpoint and, for "last", the final ones
    assert here["full_state_dict_best"] == here["loaded_weights"]
    assert here["full_state_dict_last"] == here["final_weights"]
    kept = sorted(here["best_k_models"])
    newest = max(here["folder"], key=lambda n: int(n.split("-")[0].split("=")[1]))
    assert here["folder"] == sorted({*kept, newest})  # the top 2, and the newest (what "last" resumes)


def test_lit_autoencoder_keeps_the_same_best_checkpoints_as_under_lightning(tmp_path):
    results = run_both(tmp_path, 1)
    (lightning,), (here,) = results["lightning"], results["trainer"]
    assert_same_checkpoints(lightning, here)
    assert (
        here["stopped_epoch"] == len(here["val_losses"]) - 1 == 6
    )  # early stopping ended it (max_epochs=10)
    epochs = sorted(int(n.split("-")[0].split("=")[1]) for n in here["best_k_models"])
    assert epochs != [5, 6], "the best two are the last two: the run does not tell top-k from newest-k"


@pytest.mark.slow
def test_under_ddp_and_fsdp_on_two_processes_the_best_checkpoints_load_into_one_process(tmp_path):
    results = run_both(tmp_path, 2)
    for rank in range(2):
        assert_same_checkpoints(results["lightning"][rank], results["trainer"][rank])
    # FSDP writes DCP shards of each rank; this one process reads them whole, equal to the DDP run's
    fsdp = run_both(tmp_path / "fsdp", 2, "fsdp")["trainer"][0]
    ddp = results["trainer"][0]
    best = Path(fsdp["best_model_dir"])
    assert ckpt.read_meta(best)["format"] == "dcp" and len(list((best / "dcp").glob("*.distcp"))) == 2
    from trainer.checkpoint.weights import read_checkpoint

    weights, state = read_checkpoint(best)  # here: one process, no process group
    assert state["hyper_parameters"] == ddp["loaded_hparams"]
    assert fsdp["best_k_models"].keys() == ddp["best_k_models"].keys()
    # test(model, ckpt_path="best") of the module the FSDP fit sharded: the same numbers as under DDP
    assert fsdp["test"] == pytest.approx(ddp["test"], abs=1e-5)
    for name, value in ddp["loaded_weights"].items():
        assert weights[name].flatten().tolist() == pytest.approx(value, abs=1e-5), name
        assert fsdp["loaded_weights"][name] == pytest.approx(value, abs=1e-5), name


# ---- this project's side, in one process ---------------------------------------------------------
def test_monitor_without_an_interval_saves_after_each_validation_and_keeps_the_top_k(tmp_path):
    cb = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=2, filename="{epoch}-{val_loss:.3f}")
    trainer, module = fit(tmp_path, 4, cb, num_sanity_val_steps=0)
    scores = {float(torch.as_tensor(s)) for s in cb.best_k_models.values()}
    assert len(cb.best_k_models) == 2 and cb.best_model_score == min(scores)
    assert Path(cb.best_model_path).name.startswith("epoch=") and Path(cb.best_model_path).is_dir()
    assert cb.kth_best_model_path in cb.best_k_models and cb.kth_best_model_path != cb.best_model_path
    assert cb.last_model_path == str(max(cb.saved, key=lambda c: c.step).path)  # the newest, kept
    assert cb.state_dict()["best_model_path"] == cb.best_model_path
    # validation and test read the same batches: the best checkpoint tests at its validation score
    tested = trainer.test(module, regression_loader(n=32), ckpt_path="best")["test_loss"]
    assert tested == pytest.approx(float(cb.best_model_score), abs=1e-6)
    loaded = Lit.load_from_checkpoint(cb.best_model_path)
    assert trainer.test(loaded, regression_loader(n=32))["test_loss"] == pytest.approx(tested, abs=1e-6)


def test_every_n_epochs_save_top_k_zero_and_the_last_link(tmp_path):
    cb = ModelCheckpoint(filename="{epoch}", every_n_epochs=2, save_top_k=-1, save_last="link")
    fit(tmp_path / "a", 4, cb, num_sanity_val_steps=0)
    assert names(cb.dirpath) == ["epoch=1", "epoch=3", "last"]  # epochs 2 and 4, and the link
    assert (cb.dirpath / "last").resolve() == (cb.dirpath / "epoch=3").resolve()
    assert cb.last_model_path == str(cb.dirpath / "last")
    assert Lit.load_from_checkpoint(cb.last_model_path).hparams == {"hidden": 8, "lr": 0.05, "act": None}
    none = ModelCheckpoint(monitor="val_loss", save_top_k=0, save_last=False)
    fit(tmp_path / "b", 2, none, num_sanity_val_steps=0)
    assert not (tmp_path / "b" / "checkpoints").exists() or names(tmp_path / "b" / "checkpoints") == []
    assert none.best_model_path == "" and none.best_k_models == {}


def test_a_taken_name_gets_a_version_and_a_resume_goes_on_from_named_checkpoints(tmp_path):
    cb = ModelCheckpoint(filename="fixed", every_n_train_steps=2, save_top_k=-1, save_last=False)
    trainer = Trainer(max_steps=6, seed=0, default_root_dir=tmp_path, callbacks=[cb], **quiet())
    trainer.fit(Lit(), regression_loader(n=64))
    assert names(cb.dirpath) == ["fixed", "fixed-v1", "fixed-v2"]  # nothing written over
    assert [ckpt.read_meta(cb.dirpath / n)["step"] for n in names(cb.dirpath)] == [2, 4, 6]
    again = ModelCheckpoint(filename="fixed", every_n_train_steps=2, save_top_k=2, save_last=False)
    resumed = Trainer(max_steps=8, seed=0, default_root_dir=tmp_path, callbacks=[again], **quiet())
    resumed.fit(Lit(), regression_loader(n=64), ckpt_path="last")  # the newest: fixed-v2, step 6
    assert resumed.global_step == 8 and again.dirpath == cb.dirpath
    assert names(cb.dirpath) == ["fixed-v2", "fixed-v3"]  # the run's own older ones pruned, by their meta


def test_save_checkpoint_with_a_file_name_writes_that_directory_and_says_so(tmp_path, caplog):
    trainer, module = fit(tmp_path, 1, enable_checkpointing=False)
    with caplog.at_level(logging.INFO):
        path = trainer.save_checkpoint(tmp_path / "example.ckpt")
    assert path == tmp_path / "example.ckpt" and path.is_dir()
    said = [r.getMessage() for r in caplog.records if "example.ckpt" in r.getMessage()]
    assert len(said) == 1 and "is a checkpoint directory" in said[0] and "load_from_checkpoint" in said[0]
    loaded = Lit.load_from_checkpoint(path, hidden=8, lr=0.5)  # overrides replace the saved hparams
    assert loaded.hparams.lr == 0.5 and isinstance(loaded, Lit)
    for name, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert trainer.full_state_dict(path).keys() == module.state_dict().keys()
    again = Trainer(
        max_epochs=2, seed=0, default_root_dir=tmp_path / "b", **quiet(enable_checkpointing=False)
    )
    again.fit(Lit(), regression_loader(n=64), ckpt_path=path)  # a fit resumes from it, as from any checkpoint
    assert again.current_epoch == 2


def test_weights_only_checkpoints_load_but_do_not_resume(tmp_path):
    cb = ModelCheckpoint(save_weights_only=True, save_top_k=1)
    trainer, module = fit(tmp_path, 1, cb)
    (saved,) = [str(c.path) for c in cb.saved]
    assert not (Path(saved) / ckpt.OPTIMIZER_FILE).exists()
    assert Lit.load_from_checkpoint(saved).state_dict().keys() == module.state_dict().keys()
    with pytest.raises(ckpt.CheckpointError, match="holds the weights only .save_weights_only.: fit cannot"):
        Trainer(max_epochs=2, default_root_dir=tmp_path / "b", **quiet()).fit(
            Lit(), regression_loader(n=64), ckpt_path=saved
        )


def test_load_from_checkpoint_asks_for_what_it_could_not_save_and_best_needs_a_fit(tmp_path):
    module = Lit(act=torch.nn.ReLU())
    trainer = Trainer(max_steps=1, seed=0, default_root_dir=tmp_path, **quiet(enable_checkpointing=False))
    trainer.fit(module, regression_loader(n=64))
    path = trainer.save_checkpoint(tmp_path / "with-module")
    with pytest.raises(ValueError, match=r"^Lit.load_from_checkpoint: hparam\(s\) act were not plain values"):
        Lit.load_from_checkpoint(path)
    assert isinstance(Lit.load_from_checkpoint(path, act=torch.nn.ReLU()).net[1], torch.nn.ReLU)
    with pytest.raises(
        ckpt.CheckpointError, match="^ckpt_path='best' needs a fit of this Trainer with a Mod"
    ):
        Trainer(default_root_dir=tmp_path / "c", **quiet()).test(
            module, regression_loader(n=32), ckpt_path="best"
        )
    with pytest.raises(FileNotFoundError, match="'best' is for validate, test and predict"):
        Trainer(default_root_dir=tmp_path, **quiet()).fit(module, regression_loader(n=64), ckpt_path="best")
