"""Lightning's LambdaCallback, BasePredictionWriter, GradientAccumulationScheduler and OnExceptionCheckpoint run
under PyTorch Lightning and here on the same module, weights and data (tests/lightning_twins.py): the hooks
called, the files written and what they hold, the accumulation per epoch and the weights it leads to, the
checkpoint a failing fit leaves and where resuming from it ends; Lightning's error cases fail here too."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import pytorch_lightning.callbacks as lit_callbacks
import torch
from helpers import regression_data
from lightning_twins import assert_same_weights, loader, nets, trainers
from torch.utils.data import DataLoader

import callbacks
from trainer import Trainer
from trainer import checkpoint as ckpt
from trainer.flags import LoopFlags


# ---- LambdaCallback ------------------------------------------------------------------------------------
def recorder(lambda_callback: type, calls: list) -> object:
    """A LambdaCallback whose every hook records its name and, for batch hooks, the batch index."""
    hooks = [
        "setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
        "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end",
        "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_exception",
        "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end",
        "on_predict_batch_start", "on_predict_batch_end",
    ]  # fmt: skip

    def hook(name: str):
        def record(trainer, module, *args, **kwargs):
            index = {"on_train_batch_start": 1, "on_train_batch_end": 2, "on_predict_batch_start": 1}
            index["on_predict_batch_end"] = 2
            calls.append((name, args[index[name]]) if name in index else name)

        return record

    return lambda_callback(**{name: hook(name) for name in hooks})


def test_lambda_callback_hooks_fire_as_under_lightning():
    lit_calls, our_calls = [], []
    lit, ours = nets()
    lit_trainer, our_trainer = trainers(
        Path("."),
        [recorder(lit_callbacks.LambdaCallback, lit_calls)],
        [recorder(callbacks.LambdaCallback, our_calls)],
        max_epochs=2,
    )
    lit_trainer.fit(lit, loader(n=32))
    our_trainer.fit(ours, loader(n=32))
    lit_trainer.predict(lit, loader(n=16))
    our_trainer.predict(ours, loader(n=16))
    assert our_calls == lit_calls
    assert ("on_train_batch_end", 3) in our_calls and ("on_predict_batch_end", 1) in our_calls
    assert_same_weights(lit, ours)


def test_lambda_callback_refuses_a_name_that_is_no_hook():
    with pytest.raises(TypeError):
        lit_callbacks.LambdaCallback(on_epoch_done=print)
    with pytest.raises(TypeError, match="on_epoch_done=, which is no callback hook"):
        callbacks.LambdaCallback(on_epoch_done=print)


# ---- BasePredictionWriter ------------------------------------------------------------------------------
def writer_class(base: type) -> type:
    class Writer(base):
        """Writes each batch's and the epoch's predictions with their dataset indices."""

        def __init__(self, out: Path, write_interval: str) -> None:
            super().__init__(write_interval)
            self.out = out

        def write_on_batch_end(
            self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
        ):
            record = {"prediction": prediction, "indices": list(batch_indices), "loader": dataloader_idx}
            torch.save(record, self.out / f"batch-{batch_idx}.pt")

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            torch.save({"predictions": list(predictions), "indices": batch_indices}, self.out / "epoch.pt")

    return Writer


def shuffled_loader() -> DataLoader:
    """20 samples in a seeded random order, batches of 8, 8 and 4: indices that are not 0, 1, 2, ..."""
    return DataLoader(
        regression_data(20), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)
    )


@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
def test_prediction_writer_writes_what_lightnings_writes(tmp_path, interval):
    out = {"lightning": tmp_path / "lightning", "ours": tmp_path / "ours"}
    for folder in out.values():
        folder.mkdir()
    lit, ours = nets()
    lit_trainer, our_trainer = trainers(
        tmp_path,
        [writer_class(lit_callbacks.BasePredictionWriter)(out["lightning"], interval)],
        [writer_class(callbacks.BasePredictionWriter)(out["ours"], interval)],
    )
    lit_trainer.predict(lit, shuffled_loader())
    our_trainer.predict(ours, shuffled_loader())
    names = sorted(p.name for p in out["lightning"].iterdir())
    assert sorted(p.name for p in out["ours"].iterdir()) == names
    assert len(names) == {"batch": 3, "epoch": 1, "batch_and_epoch": 4}[interval]
    for name in names:
        theirs, mine = (torch.load(out[side] / name) for side in ("lightning", "ours"))
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            if key == "predictions":
                assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(mine[key], value, strict=True))
            elif key == "prediction":
                assert torch.allclose(mine[key], value, atol=1e-6)
            else:
                assert mine[key] == value, (name, key)
    if interval != "batch":  # every sample once, in the shuffled order
        (indices,) = torch.load(out["ours"] / "epoch.pt")["indices"]
        assert sorted(i for batch in indices for i in batch) == list(range(20))
        assert [len(batch) for batch in indices] == [8, 8, 4] and indices[0] != list(range(8))


def test_prediction_writer_refuses_an_unknown_interval():
    with pytest.raises(Exception, match="write_interval"):
        lit_callbacks.BasePredictionWriter("step")
    with pytest.raises(ValueError, match="write_interval='step' is invalid"):
        callbacks.BasePredictionWriter("step")


# ---- GradientAccumulationScheduler ---------------------------------------------------------------------
def factors_seen(lambda_callback: type, seen: list) -> object:
    """Records, at each epoch's start (after the scheduler), the epoch, its factor and the step count."""
    return lambda_callback(
        on_train_epoch_start=lambda t, m: seen.append(
            (t.current_epoch, t.accumulate_grad_batches, t.global_step)
        )
    )


def test_accumulation_schedule_gives_lightnings_factors_steps_and_weights():
    schedule = {1: 2, 2: 4}
    lit_seen, our_seen = [], []
    lit, ours = nets()
    lit_trainer, our_trainer = trainers(
        Path("."),
        [
            lit_callbacks.GradientAccumulationScheduler(dict(schedule)),
            factors_seen(lit_callbacks.LambdaCallback, lit_seen),
        ],
        [
            callbacks.GradientAccumulationScheduler(dict(schedule)),
            factors_seen(callbacks.LambdaCallback, our_seen),
        ],
        max_epochs=4,
    )
    lit_trainer.fit(lit, loader(n=64))
    our_trainer.fit(ours, loader(n=64))
    # 8 batches an epoch: 8 steps, then 4, then 2, then 2
    assert our_seen == lit_seen == [(0, 1, 0), (1, 2, 8), (2, 4, 12), (3, 4, 14)]
    assert our_trainer.global_step == lit_trainer.global_step == 16
    assert_same_weights(lit, ours)


def test_accumulation_schedule_is_set_again_on_resume(tmp_path):
    """A fit resumed in epoch 2 accumulates 4 from its first step, as one that ran through."""
    schedule = {2: 4}
    _, straight = nets()
    Trainer(max_epochs=3, callbacks=[callbacks.GradientAccumulationScheduler(schedule)], default_root_dir=tmp_path / "a",
            enable_progress_bar=False, logger=False).fit(straight, loader(n=64))  # fmt: skip
    _, first = nets()
    first_trainer = Trainer(max_epochs=2, callbacks=[callbacks.GradientAccumulationScheduler(schedule)],
                            default_root_dir=tmp_path / "b", enable_progress_bar=False, logger=False)  # fmt: skip
    first_trainer.fit(first, loader(n=64))
    _, resumed = nets()
    again = Trainer(max_epochs=3, callbacks=[callbacks.GradientAccumulationScheduler(schedule)],
                    default_root_dir=tmp_path / "b", enable_progress_bar=False, logger=False)  # fmt: skip
    again.fit(resumed, loader(n=64), ckpt_path="last")
    assert (again.global_step, again.accumulate_grad_batches) == (18, 4)
    assert_same_weights(straight, resumed)


@pytest.mark.parametrize("scheduling", [{}, {-1: 2}, {"1": 2}, {1: 0}, {1: 1.5}])
def test_accumulation_schedule_refuses_what_lightning_refuses(scheduling):
    with pytest.raises(Exception):  # noqa: B017 - Lightning's MisconfigurationException or TypeError
        lit_callbacks.GradientAccumulationScheduler(dict(scheduling))
    with pytest.raises((TypeError, ValueError), match="GradientAccumulationScheduler"):
        callbacks.GradientAccumulationScheduler(dict(scheduling))


def test_accumulation_schedule_next_to_the_trainers_accumulation_fails_as_under_lightning():
    lit, ours = nets()
    lit_trainer, our_trainer = trainers(
        Path("."),
        [lit_callbacks.GradientAccumulationScheduler({1: 2})],
        [callbacks.GradientAccumulationScheduler({1: 2})],
        accumulate_grad_batches=2,
    )
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        lit_trainer.fit(lit, loader())
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\) and GradientAccumulationScheduler"):
        our_trainer.fit(ours, loader())


def test_accumulate_grad_batches_is_writable_checked_and_the_flags_stay_one_frozen_object():
    trainer = Trainer(accumulate_grad_batches=2, max_steps=7)
    before = trainer.flags
    trainer.accumulate_grad_batches = 3
    assert trainer.accumulate_grad_batches == trainer.flags.accumulate_grad_batches == 3
    assert isinstance(trainer.flags, LoopFlags) and trainer.flags is not before
    assert trainer.flags.max_steps == 7 and before.accumulate_grad_batches == 2
    with pytest.raises(ValueError, match="accumulate_grad_batches=0 is invalid"):
        trainer.accumulate_grad_batches = 0
    with pytest.raises(AttributeError):
        trainer.max_steps = 3  # the other flags stay read-only


# ---- OnExceptionCheckpoint -----------------------------------------------------------------------------
def test_a_failing_fit_leaves_lightnings_checkpoint_and_resuming_from_it_ends_as_an_unbroken_run(tmp_path):
    lit, ours = nets(fail_at=5)
    lit_trainer, our_trainer = trainers(
        tmp_path,
        [lit_callbacks.OnExceptionCheckpoint(tmp_path / "lightning")],
        [callbacks.OnExceptionCheckpoint(tmp_path / "ours")],
        max_epochs=2,
        enable_checkpointing=True,  # Lightning counts OnExceptionCheckpoint as checkpointing (README)
    )
    for trainer, module in ((lit_trainer, lit), (our_trainer, ours)):
        with pytest.raises(RuntimeError, match="failing at step 5"):
            trainer.fit(module, loader(n=64))
    theirs = torch.load(tmp_path / "lightning" / "on_exception.ckpt", weights_only=False)
    path = tmp_path / "ours" / "on_exception.ckpt"
    assert theirs["global_step"] == ckpt.read_meta(path)["step"] == 5
    reloaded = type(ours).load_from_checkpoint(path)
    assert_same_weights(lit, reloaded)
    for name, value in theirs["state_dict"].items():
        assert torch.allclose(reloaded.state_dict()[name], value, atol=1e-6), name

    straight, resumed = nets()
    trainers(tmp_path / "straight", [], [], max_epochs=2)[0].fit(straight, loader(n=64))
    _, again = trainers(tmp_path / "resumed", [], [], max_epochs=2)
    again.fit(resumed, loader(n=64), ckpt_path=path)
    assert again.global_step == 16
    assert_same_weights(straight, resumed)


def test_a_taken_name_is_never_written_over_nor_deleted(tmp_path):
    """An earlier failure's checkpoint stays: the next failure writes `-v1`, and a fit that succeeds keeps
    both (Lightning's deletes `on_exception.ckpt` when a fit succeeds, and overwrites it on the next failure)."""
    folder = tmp_path / "ckpts"
    _, failing = nets(fail_at=3)
    make = lambda: trainers(tmp_path, [], [callbacks.OnExceptionCheckpoint(folder)], max_epochs=1)[1]  # noqa: E731
    with pytest.raises(RuntimeError):
        make().fit(failing, loader())
    first = ckpt.read_meta(folder / "on_exception.ckpt")
    _, failing_later = nets(fail_at=6)
    with pytest.raises(RuntimeError):
        make().fit(failing_later, loader())
    assert ckpt.read_meta(folder / "on_exception.ckpt") == first
    assert ckpt.read_meta(folder / "on_exception-v1.ckpt")["step"] == 6
    make().fit(nets()[1], loader())
    assert sorted(p.name for p in folder.iterdir()) == ["on_exception-v1.ckpt", "on_exception.ckpt"]

    lit_folder = tmp_path / "lightning"

    def lit_fit(module, **kwargs):
        pl.Trainer(callbacks=[lit_callbacks.OnExceptionCheckpoint(lit_folder)], max_epochs=1,
                   default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
                   accelerator="cpu", devices=1, logger=False).fit(module, loader(), **kwargs)  # fmt: skip

    with pytest.raises(RuntimeError):
        lit_fit(nets(fail_at=3)[0])
    assert (lit_folder / "on_exception.ckpt").exists()
    lit_fit(nets()[0], ckpt_path=lit_folder / "on_exception.ckpt")
    assert not (lit_folder / "on_exception.ckpt").exists()


def test_a_failure_before_the_fit_started_saves_nothing(tmp_path):
    class FailsInSetup(callbacks.Callback):
        def on_fit_start(self, trainer, module):
            raise RuntimeError("broken set-up")

    saver = callbacks.OnExceptionCheckpoint(tmp_path / "ckpts")
    _, ours = nets()
    trainer = trainers(tmp_path, [], [FailsInSetup(), saver], max_epochs=1)[1]
    with pytest.raises(RuntimeError, match="broken set-up"):
        trainer.fit(ours, loader())
    assert not (tmp_path / "ckpts").exists()


def test_an_empty_filename_fails_as_under_lightning():
    with pytest.raises(ValueError):
        lit_callbacks.OnExceptionCheckpoint(".", filename="")
    with pytest.raises(ValueError, match="empty filename"):
        callbacks.OnExceptionCheckpoint(".", filename="")
