"""A LightningModule as Lightning's docs write one runs here (the hook order against Lightning itself is
in test_lightning_parity): callbacks before the module,
`save_hyperparameters`/`hparams`, the attributes a step reads, a `training_step` that returns None,
and a one-time notice for Lightning hooks this Trainer does not call."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import SCRIPTS, quiet, regression_data, run_ranks
from torch import nn
from torch.utils.data import DataLoader

from callbacks import Callback
from trainer import Trainer, TrainModule
from trainer.checkpoint import load_torch_file


class HookRecorder(TrainModule):
    """Records every hook call (the module's) in order."""

    def __init__(self, calls):
        super().__init__()
        self.layer, self.calls = nn.Linear(8, 1), calls
        for name in HOOKS:
            setattr(self, name, self._recorder(name))

    def _recorder(self, name):
        return lambda *args: self.calls.append(name)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        self.calls.append("training_step")
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        self.calls.append("validation_step")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


HOOKS = [
    "setup",
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
    "teardown",
]


def test_callbacks_get_each_hook_before_the_module(tmp_path):
    calls: list[str] = []

    class Spy(Callback):
        def on_train_epoch_end(self, trainer, module):
            calls.append("callback")

        def on_before_zero_grad(self, trainer, module, optimizer):
            calls.append("callback zero_grad")

    module = HookRecorder(calls)
    Trainer(max_steps=1, default_root_dir=tmp_path, callbacks=[Spy()], **quiet()).fit(
        module, DataLoader(regression_data(16), batch_size=16)
    )
    assert calls.index("callback zero_grad") == calls.index("on_before_zero_grad") - 1
    assert calls.index("callback") == calls.index("on_train_epoch_end") - 1


class LitModel(TrainModule):
    """Lightning's docs' classifier shape: hyperparameters saved from __init__."""

    def __init__(self, lr: float = 0.1, hidden: int = 16, activation: str = "tanh", debug_tensor=None):
        super().__init__()
        self.save_hyperparameters(ignore="debug_tensor")
        self.net = nn.Sequential(
            nn.Linear(8, self.hparams.hidden), nn.Tanh(), nn.Linear(self.hparams.hidden, 1)
        )
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(
            {"epoch": self.current_epoch, "step": self.global_step, "rank": self.global_rank,
             "local_rank": self.local_rank, "lr": self.optimizers().param_groups[0]["lr"],
             "scheduler": type(self.lr_schedulers()).__name__}
        )  # fmt: skip
        self.print(f"batch {batch_idx}")
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}


def test_save_hyperparameters_keeps_init_arguments_in_hparams_logs_and_checkpoints(tmp_path):
    model = LitModel(lr=0.05, hidden=4, debug_tensor=torch.zeros(3))
    assert dict(model.hparams) == {"lr": 0.05, "hidden": 4, "activation": "tanh"}
    assert model.hparams.hidden == 4
    trainer = Trainer(max_steps=2, default_root_dir=tmp_path, **quiet())
    trainer.fit(model, DataLoader(regression_data(32), batch_size=16))
    logged = json.loads((tmp_path / "logs" / "hparams.json").read_text())
    assert logged["hparams"] == {"lr": 0.05, "hidden": 4, "activation": "tanh"}
    state = load_torch_file(trainer.save_checkpoint() / "state.pt")
    assert state["hyper_parameters"] == {"lr": 0.05, "hidden": 4, "activation": "tanh"}


def test_save_hyperparameters_by_name_and_a_name_that_is_not_an_argument():
    class Named(TrainModule):
        def __init__(self, lr=0.1, width=3):
            super().__init__()
            self.save_hyperparameters("width")

    class Wrong(TrainModule):
        def __init__(self, lr=0.1):
            super().__init__()
            self.save_hyperparameters("learning_rate")

    assert dict(Named().hparams) == {"width": 3}
    with pytest.raises(
        ValueError,
        match=r"save_hyperparameters\('learning_rate',\): not arguments of Wrong.__init__; allowed: lr",
    ):
        Wrong()
    with pytest.raises(AttributeError, match=r"hparams has no 'momentum'; saved: width"):
        _ = Named().hparams.momentum


def test_a_step_reads_epoch_step_ranks_optimizer_and_scheduler_and_prints_on_rank_zero(tmp_path, capsys):
    model = LitModel()
    Trainer(max_epochs=2, default_root_dir=tmp_path, **quiet()).fit(
        model, DataLoader(regression_data(32), batch_size=16)
    )
    assert [(s["epoch"], s["step"]) for s in model.seen] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert {(s["rank"], s["local_rank"], s["scheduler"]) for s in model.seen} == {(0, 0, "StepLR")}
    assert [s["lr"] for s in model.seen] == [0.1, 0.1, 0.05, 0.05]  # Lightning's default: per epoch
    assert "batch 1" in capsys.readouterr().out


class SkipsOddBatches(LitModel):
    def training_step(self, batch, batch_idx):
        if batch_idx % 2:
            return None  # Lightning: skip this batch's update
        return super().training_step(batch, batch_idx)


def test_a_training_step_returning_none_skips_that_update_and_is_said_once(tmp_path, caplog):
    model = SkipsOddBatches()
    before: list[torch.Tensor] = []

    class Weights(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            before.append(module.net[0].weight.detach().clone())

    trainer = Trainer(max_steps=4, default_root_dir=tmp_path, callbacks=[Weights()], **quiet())
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer.fit(model, DataLoader(regression_data(64), batch_size=16))
    assert trainer.global_step == 4 and trainer.state.skipped_steps == 2
    assert not torch.equal(before[0], before[1])  # batch 0 updated the weights
    assert torch.equal(before[1], before[2])  # batch 1 returned None: no update
    assert caplog.text.count("training_step returned None") == 1


def test_a_lightning_hook_this_trainer_does_not_call_is_named_once(tmp_path, caplog):
    class WithBatchTransfer(LitModel):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            return batch

    with caplog.at_level(logging.INFO, logger="trainer"):
        for _ in range(2):
            Trainer(max_steps=1, default_root_dir=tmp_path, **quiet()).fit(
                WithBatchTransfer(), DataLoader(regression_data(16), batch_size=16)
            )
    assert (
        caplog.text.count("defines Lightning hook(s) this Trainer never calls: on_before_batch_transfer") == 1
    )


@pytest.mark.slow
def test_under_ddp_a_none_on_one_rank_skips_the_step_on_both_and_sync_dist_averages(tmp_path):
    script = SCRIPTS / "lightning_script.py"
    run_ranks(2, script, str(tmp_path), timeout=240)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["skipped_steps"] == 1 and result["global_step"] == 3
    assert result["weights_equal_across_ranks"]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    synced = [r["rank_synced"] for r in rows if "rank_synced" in r]
    assert synced and all(v == 0.5 for v in synced)  # mean of ranks 0 and 1
    assert all(r["rank_local"] == 0.0 for r in rows if "rank_local" in r)  # rank zero's own value
    # every rank's logger reads the version rank zero took (the next free one), and only rank zero wrote
    assert result["log_dirs"] == [str(tmp_path / "csv" / "lightning_logs" / "version_1")] * 2
    csv_rows = (tmp_path / "csv" / "lightning_logs" / "version_1" / "metrics.csv").read_text().splitlines()
    assert csv_rows == ["epoch,rank_local,rank_synced,step", "0,0.0,0.5,1", "0,0.0,0.5,3"]  # 2: skipped


@pytest.mark.parametrize("clip", [0, None])
def test_gradient_clip_val_zero_means_no_clipping_as_in_lightning(tmp_path, clip):
    def run(root, value):
        torch.manual_seed(0)
        model = LitModel(lr=0.5)
        Trainer(max_steps=3, seed=0, gradient_clip_val=value, default_root_dir=root, **quiet()).fit(
            model, DataLoader(regression_data(48), batch_size=16)
        )
        return [p.detach() for p in model.parameters()]

    unclipped, tiny_clip = run(tmp_path / "a", clip), run(tmp_path / "b", 1e-4)
    assert all(torch.equal(a, b) for a, b in zip(unclipped, run(tmp_path / "c", None), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(unclipped, tiny_clip, strict=True))


def test_save_hyperparameters_takes_keyword_only_and_extra_keyword_arguments():
    class Flexible(TrainModule):
        def __init__(self, width, *layers, depth=2, **extra):
            super().__init__()
            self.save_hyperparameters(ignore=["layers"])

    assert dict(Flexible(8, "a", depth=3, dropout=0.1).hparams) == {"width": 8, "depth": 3, "dropout": 0.1}
