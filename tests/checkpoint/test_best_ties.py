"""One "best" checkpoint: `best_model_path`, `ckpt_path="best"` and HFModule's `load_best_model_at_end`
name the same one when the monitored value ties across saves (the older, as Lightning keeps the first of
equal values), and a NaN value never beats a number: all three ask trainer/checkpoint/records.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import quiet, regression_loader
from torch.utils.data import DataLoader
from transformers import BertConfig

from callbacks import ModelCheckpoint
from trainer import Trainer, TrainModule
from trainer.checkpoint import MODEL_FILE, CheckpointError, load_model_file
from trainer.checkpoint.records import SavedCheckpoint, best, ranked
from trainer.models.hf import HFModule

# the value validation reports at each save, per mode: steps 2 and 4 tie at the best, step 6 is worse
TIED = {"min": {2: 0.5, 4: 0.5, 6: 0.9}, "max": {2: 0.9, 4: 0.9, 6: 0.5}}


class Scored(TrainModule):
    """A Lightning user's module: validation logs `val_score` from a script of values by step."""

    def __init__(self, scores: dict[int, float]) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.scores = scores

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_score", self.scores[self.global_step])
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_scored(
    root: Path, scores: dict[int, float], mode: str, save_top_k: int = 2
) -> tuple[Trainer, Scored, ModelCheckpoint]:
    """Six steps, validated (and saved, Lightning's way with `monitor`) at steps 2, 4 and 6."""
    saver = ModelCheckpoint(monitor="val_score", mode=mode, save_top_k=save_top_k)
    module = Scored(scores)
    trainer = Trainer(
        max_steps=6, val_check_interval=2, seed=0, default_root_dir=root, callbacks=[saver],
        **quiet(num_sanity_val_steps=0),
    )  # fmt: skip
    trainer.fit(module, regression_loader(n=64), regression_loader(n=32))
    return trainer, module, saver


def weights_of(step_dir: Path) -> dict[str, torch.Tensor]:
    return load_model_file(step_dir / MODEL_FILE)


def assert_holds(module: torch.nn.Module, step_dir: Path) -> None:
    live = module.state_dict()
    assert all(torch.equal(live[k], v) for k, v in weights_of(step_dir).items()), (
        f"not {step_dir.name}'s weights"
    )


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_tie_names_the_older_checkpoint_for_best_model_path_and_ckpt_path_best(tmp_path, mode):
    trainer, module, saver = fit_scored(tmp_path, TIED[mode], mode)
    folder = Path(saver.dirpath)
    older, newer = folder / "step-00000002", folder / "step-00000004"
    # the two tied checkpoints hold different weights: loading one is told from loading the other
    assert any(not torch.equal(v, weights_of(newer)[k]) for k, v in weights_of(older).items())
    assert saver.best_model_path == str(older)
    assert float(saver.best_model_score) == pytest.approx(TIED[mode][2])
    assert list(saver.best_k_models) == [str(older), str(newer)] and saver.kth_best_model_path == str(newer)
    assert saver.state_dict()["best_model_path"] == str(older)

    trainer.validate(module, regression_loader(n=32), ckpt_path="best")
    assert_holds(module, older)
    assert trainer.full_state_dict("best").keys() == weights_of(older).keys()
    assert all(torch.equal(trainer.full_state_dict("best")[k], v) for k, v in weights_of(older).items())


def test_a_nan_score_is_never_best_while_another_checkpoint_has_a_number(tmp_path):
    # every checkpoint kept: the NaN one too is there to be (wrongly) picked
    trainer, module, saver = fit_scored(tmp_path, {2: math.nan, 4: 0.9, 6: 0.7}, "min", save_top_k=-1)
    lowest = Path(saver.dirpath) / "step-00000006"
    assert saver.best_model_path == str(lowest)
    assert list(saver.best_k_models)[-1] == str(Path(saver.dirpath) / "step-00000002")
    trainer.validate(module, regression_loader(n=32), ckpt_path="best")
    assert_holds(module, lowest)


def test_the_one_rule_ranks_by_score_then_the_older_and_puts_nan_and_unscored_last():
    entries = [
        SavedCheckpoint(Path("a"), 8, 0.5),
        SavedCheckpoint(Path("b"), 2, None),
        SavedCheckpoint(Path("c"), 4, 0.5),
        SavedCheckpoint(Path("d"), 6, math.nan),
        SavedCheckpoint(Path("e"), 10, 0.1, good=False),
    ]
    # of equal scores the older; without a score or NaN last, there too the older first
    assert [c.step for c in ranked(entries, "min")] == [10, 4, 8, 2, 6]
    assert [c.step for c in ranked(entries, "max")] == [4, 8, 10, 2, 6]
    assert best(entries, "min").step == 4  # 0.1 awaits its validation: not a candidate yet
    assert best(entries, "max").step == 4
    assert best(entries[1:2], "min") is None  # a checkpoint without a score is never "best"


TINY_BERT = {
    "vocab_size": 48, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 64, "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}  # fmt: skip


def class_batches(n: int, seed: int) -> DataLoader:
    """Sequences of 8 tokens, classed by the third of the vocabulary their first token falls in."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 48, (n, 8), generator=g)
    rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i[0] * 3 // 48} for i in ids]
    return DataLoader(rows, batch_size=16)


@pytest.mark.parametrize("mode", ["min", "max"])
def test_load_best_model_at_end_loads_the_older_of_two_tied_checkpoints(tmp_path, mode):
    def tie(predictions, labels):  # a compute_metrics: the validations at steps 2 and 4 tie at the best
        return {"tie": TIED[mode][module.global_step]}

    torch.manual_seed(0)
    module = HFModule(
        BertConfig(**TINY_BERT), task="seq-classification", num_labels=3, lr=3e-3, metrics=[tie],
        load_best_model_at_end=True,
    )  # fmt: skip
    saver = ModelCheckpoint(monitor="val_tie", mode=mode, save_top_k=-1)
    trainer = Trainer(
        max_steps=6, val_check_interval=2, seed=0, default_root_dir=tmp_path, callbacks=[saver],
        **quiet(num_sanity_val_steps=0),
    )  # fmt: skip
    val = class_batches(16, 1)
    trainer.fit(module, class_batches(96, 0), val)
    older, newer = Path(saver.dirpath) / "step-00000002", Path(saver.dirpath) / "step-00000004"
    assert any(not torch.equal(v, weights_of(newer)[k]) for k, v in weights_of(older).items())
    assert saver.best_model_path == str(older)
    assert_holds(module, older)
    trainer.validate(module, val, ckpt_path="best")
    assert_holds(module, older)


def test_a_saver_that_keeps_no_best_has_no_best_for_any_reader(tmp_path):
    saver = ModelCheckpoint(monitor="val_score", save_top_k=0, save_last=True)
    trainer = Trainer(
        max_steps=4, val_check_interval=2, seed=0, default_root_dir=tmp_path, callbacks=[saver],
        **quiet(num_sanity_val_steps=0),
    )  # fmt: skip
    module = Scored(TIED["min"])
    trainer.fit(module, regression_loader(n=64), regression_loader(n=32))
    assert saver.best_model_path == ""  # as Lightning's, which also refuses ckpt_path="best" then
    with pytest.raises(CheckpointError, match=r"keeps no best checkpoint \(save_top_k=0\)"):
        trainer.validate(module, regression_loader(n=32), ckpt_path="best")
