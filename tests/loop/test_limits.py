"""`limit_train_batches` / `limit_val_batches`: an int is a count of batches, a float a fraction of the
loader's length (rounded down); both are read from the user's side, by counting the steps the module
was given and by recomputing the logged validation loss from the data."""

from __future__ import annotations

import pytest
import torch
from helpers import Regression, StopAt, quiet, read_metrics, regression_data
from torch.utils.data import DataLoader

from trainer import Trainer

TRAIN_N, TRAIN_BS = 256, 16  # 16 training batches per epoch
VAL_N, VAL_BS = 64, 8  # 8 validation batches


class Counting(Regression):
    """Records every training_step as (epoch, batch_idx, first feature of the batch) and every
    validation_step as (global step, batch_idx)."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.train_calls: list[tuple[int, int, float]] = []
        self.val_calls: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        self.train_calls.append((self.trainer.current_epoch, batch_idx, batch[0][0, 0].item()))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.val_calls.append((self.trainer.global_step, batch_idx))
        return super().validation_step(batch, batch_idx)

    def per_epoch(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for epoch, idx, _ in self.train_calls:
            out.setdefault(epoch, []).append(idx)
        return out

    def per_validation(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for step, idx in self.val_calls:
            out.setdefault(step, []).append(idx)
        return out


def train_loader() -> DataLoader:
    return DataLoader(regression_data(TRAIN_N, seed=0), batch_size=TRAIN_BS)


def val_loader() -> DataLoader:
    return DataLoader(regression_data(VAL_N, seed=1), batch_size=VAL_BS)


def fit(root, module, *, val=None, ckpt_path=None, callbacks=(), **kwargs) -> Trainer:
    trainer = Trainer(
        seed=0,
        default_root_dir=root,
        callbacks=list(callbacks),
        **quiet(**{"enable_checkpointing": False, **kwargs}),
    )
    trainer.fit(module, train_loader(), val, ckpt_path=ckpt_path)
    return trainer


def mean_val_loss(module: torch.nn.Module, batches: int) -> float:
    """The mean over the first `batches` validation batches of the batch MSE, computed here."""
    data = regression_data(VAL_N, seed=1)
    losses = []
    with torch.no_grad():
        for i in range(batches):
            x, y = (
                data.tensors[0][i * VAL_BS : (i + 1) * VAL_BS],
                data.tensors[1][i * VAL_BS : (i + 1) * VAL_BS],
            )
            losses.append(torch.nn.functional.mse_loss(module.net(x), y).item())
    return sum(losses) / len(losses)


@pytest.mark.parametrize(
    "limit, per_epoch", [(5, 5), (0.25, 4), (0.5, 8), (0.3, 4), (100, TRAIN_N // TRAIN_BS), (1.0, 16)]
)
def test_limit_train_batches_bounds_every_epoch(tmp_path, limit, per_epoch):
    module = Counting()
    trainer = fit(tmp_path, module, max_epochs=3, limit_train_batches=limit)
    assert module.per_epoch() == {e: list(range(per_epoch)) for e in range(3)}
    assert trainer.global_step == 3 * per_epoch and trainer.current_epoch == 3
    # the first `per_epoch` batches of the (unshuffled) loader, in order, every epoch
    x = regression_data(TRAIN_N, seed=0).tensors[0]
    firsts = [x[i * TRAIN_BS, 0].item() for i in range(per_epoch)]
    assert [v for _, _, v in module.train_calls] == firsts * 3


def test_limit_train_batches_with_accumulation_counts_micro_batches(tmp_path):
    # 5 micro-batches an epoch in windows of 2: optimizer steps of 2, 2 and 1 micro-batches
    module = Counting()
    trainer = fit(tmp_path, module, max_epochs=2, limit_train_batches=5, accumulate_grad_batches=2)
    assert module.per_epoch() == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4]}
    assert trainer.global_step == 2 * 3


def test_with_max_steps_the_limit_sets_the_epoch_length_and_the_end_of_epoch_validation(tmp_path):
    module = Counting()
    trainer = fit(tmp_path, module, val=val_loader(), max_steps=12, limit_train_batches=5)
    assert trainer.global_step == 12
    epochs = read_metrics(tmp_path, "epoch")
    assert epochs == {s: (s - 1) // 5 for s in range(1, 13)}
    # validation after each (limited) epoch, and once at the end of the run
    assert sorted(read_metrics(tmp_path, "val/loss")) == [5, 10, 12]
    assert sorted(module.per_validation()) == [0, 5, 10, 12]  # 0: the sanity check before training


@pytest.mark.parametrize("limit, batches", [(3, 3), (0.5, 4), (0.3, 2), (50, 8)])
def test_limit_val_batches_bounds_each_validation_and_its_mean(tmp_path, limit, batches):
    module = Counting()
    fit(tmp_path, module, val=val_loader(), max_epochs=2, limit_train_batches=4, limit_val_batches=limit)
    # the sanity check (2 batches, within the limit), then one validation after each epoch (steps 4 and
    # 8), each over the first `batches` batches
    first = list(range(batches))
    assert module.per_validation() == {0: first[:2], 4: first, 8: first}
    logged = read_metrics(tmp_path, "val/loss")
    assert sorted(logged) == [4, 8]
    # the last validation ran on the final parameters: its loss is the mean over exactly those batches
    expected = mean_val_loss(module, batches)
    assert logged[8] == pytest.approx(expected, rel=1e-5)
    if batches < VAL_N // VAL_BS:  # and the limit is visible in the value, not only in the count
        assert mean_val_loss(module, VAL_N // VAL_BS) != pytest.approx(expected, rel=1e-3)


def test_limit_val_batches_applies_to_trainer_validate(tmp_path):
    module = Counting()
    fit(tmp_path / "fit", module, max_steps=3)
    trainer = Trainer(default_root_dir=tmp_path / "val", limit_val_batches=3, **quiet())
    metrics = trainer.validate(module, val_loader())
    assert [idx for _, idx in module.val_calls] == [0, 1, 2]
    assert metrics["val/loss"] == pytest.approx(mean_val_loss(module, 3), rel=1e-5)


def test_limit_val_batches_zero_runs_no_validation_step(tmp_path):
    module = Counting()
    fit(tmp_path, module, val=val_loader(), max_epochs=2, limit_train_batches=4, limit_val_batches=0)
    assert module.val_calls == []
    assert read_metrics(tmp_path, "val/loss") == {}


def test_a_resumed_run_keeps_the_limit(tmp_path):
    first, second = Counting(), Counting()
    kwargs = {"max_epochs": 3, "limit_train_batches": 5, "enable_checkpointing": True}
    fit(tmp_path, first, callbacks=[StopAt(7)], **kwargs)
    assert first.per_epoch() == {0: [0, 1, 2, 3, 4], 1: [0, 1]}
    trainer = fit(tmp_path, second, ckpt_path="last", **kwargs)
    assert second.per_epoch() == {1: [2, 3, 4], 2: [0, 1, 2, 3, 4]}
    assert trainer.global_step == 15


class NoLen:
    """An iterable loader without len(): 10 batches per pass."""

    def __iter__(self):
        data = regression_data(160, seed=0)
        for i in range(10):
            yield data.tensors[0][i * 16 : (i + 1) * 16], data.tensors[1][i * 16 : (i + 1) * 16]


def test_an_int_limit_bounds_a_loader_without_len(tmp_path):
    module = Counting()
    trainer = Trainer(
        max_epochs=2, limit_train_batches=4, default_root_dir=tmp_path, **quiet(enable_checkpointing=False)
    )
    trainer.fit(module, NoLen())
    assert module.per_epoch() == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}


def test_a_fraction_limit_on_a_loader_without_len_is_refused(tmp_path):
    trainer = Trainer(
        max_epochs=1, limit_train_batches=0.5, default_root_dir=tmp_path, **quiet(enable_checkpointing=False)
    )
    with pytest.raises(ValueError, match="limit_train_batches=0.5 is a fraction but the loader has no len"):
        trainer.fit(Counting(), NoLen())


def test_a_train_fraction_that_keeps_no_batch_is_refused_naming_the_limit(tmp_path):
    # as Lightning's; 0 itself skips training (tests/lightning/test_trainer_arguments_twin.py)
    with pytest.raises(ValueError, match=r"limit_train_batches=0.01 leaves no batch of the train loader"):
        fit(tmp_path, Counting(), max_epochs=1, limit_train_batches=0.01)


def test_a_loader_without_len_is_read_to_its_end_in_accumulation_windows(tmp_path):
    """No limit: each pass of the 10 batches is 3 full windows of 3 micro-batches and a last one of 1."""
    module = Counting()
    trainer = Trainer(
        max_epochs=2,
        accumulate_grad_batches=3,
        default_root_dir=tmp_path,
        **quiet(enable_checkpointing=False),
    )
    trainer.fit(module, NoLen())
    assert module.per_epoch() == {0: list(range(10)), 1: list(range(10))}
    assert trainer.global_step == 8
