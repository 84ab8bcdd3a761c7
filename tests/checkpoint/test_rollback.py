"""NaNGuard's rollback puts the run back to the checkpoint it picks, bit for bit, and reads on with new data.

One run (module-scoped, it is the same for every test here): AdamW, dropout (the run depends on the RNG),
a cosine LR schedule (every step has its own LR), a shuffled loader whose samples carry their index,
ModelCheckpoint every 2 steps and NaNGuard(rollback_after=2). Steps 6 and 7 get NaN gradients: both are
skipped, and after step 7 the guard rolls back to the newest good checkpoint before step 6, step-4. Step 5
was a good step that changed the weights, the AdamW moments and step count, and drew dropout masks, so
"restored" is only true if the rollback really loads them: a rollback that kept the live values would
keep step 5's update.

The reference values are captured live (parameters, `optimizer.state_dict()`, torch/python/numpy RNG,
LR, step) at the start of step 5 the first time round, i.e. the state the step-4 checkpoint holds, and
compared with torch.equal to the same capture at the start of step 5 after the rollback. The data is
checked against the epoch's order, computed by re-iterating the loader from the RNG at the epoch's start.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
import torch
from helpers import Regression, quiet
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback, ModelCheckpoint, NaNGuard
from trainer import Trainer

STEPS = 10
POISONED = (6, 7)  # two bad steps in a row: rolled back after step 7
CKPT_EVERY = 2
RESTORED_STEP = 4  # the newest checkpoint of a step before 6 (the first bad one)
BATCH, N = 16, 256  # 16 batches per epoch: the whole run (7 + 6 steps) stays in epoch 0


class IndexedRegression(Regression):
    """Regression with dropout on (index, x, y) batches; records the sample indices each step trained on."""

    def __init__(self) -> None:
        super().__init__(dropout=0.5)
        self.trained: list[tuple[int, torch.Tensor]] = []  # (global step being taken, sample indices)

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.trained.append((self.global_step + 1, idx.clone()))
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)


def indexed_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g))
    return DataLoader(TensorDataset(torch.arange(N), x, y), batch_size=BATCH, shuffle=True)


class Poison(Callback):
    """NaN gradients at the given steps, the first time each is taken."""

    def __init__(self, steps) -> None:
        self.steps = set(steps)

    def on_after_backward(self, trainer, module):
        step = trainer.global_step + 1
        if step in self.steps:
            self.steps.discard(step)
            next(module.parameters()).grad.fill_(float("nan"))


def snapshot(trainer: Trainer, module: torch.nn.Module) -> dict[str, Any]:
    """Everything a rollback must put back, read directly (not through the trainer's checkpoint code)."""
    return {
        "step": trainer.global_step,
        "params": [p.detach().clone() for p in module.parameters()],
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "lr": [g["lr"] for g in trainer.optimizer.param_groups],
        "scheduler_step": trainer.lr_scheduler.last_epoch,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "batches_in_epoch": trainer.state.batches_in_epoch,
        "epoch": trainer.current_epoch,
    }


class Recorder(Callback):
    """Snapshots at the start of every step, and at the end of every step (placed before or after the guard)."""

    def __init__(self) -> None:
        self.starts: list[dict[str, Any]] = []
        self.ends: list[dict[str, Any]] = []
        self.epoch_start_rng: torch.Tensor | None = None

    def on_fit_start(self, trainer, module):
        # nothing draws from the RNG between here and the epoch's `iter(loader)` (the shuffle)
        self.epoch_start_rng = torch.get_rng_state()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.starts.append(snapshot(trainer, module))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.ends.append(snapshot(trainer, module))


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    """The run described at the top; returns (module, trainer, guard, before_guard, after_guard, loader)."""
    root = tmp_path_factory.mktemp("rollback")
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    module, loader = IndexedRegression(), indexed_loader()
    guard, before_guard, after_guard = NaNGuard(rollback_after=2), Recorder(), Recorder()
    trainer = Trainer(
        max_steps=STEPS,
        seed=0,
        default_root_dir=root,
        lr_schedule="cosine",
        warmup_steps=2,
        callbacks=[
            Poison(POISONED),
            ModelCheckpoint(every_n_steps=CKPT_EVERY, save_top_k=-1),
            before_guard,
            guard,
            after_guard,
        ],
        **quiet(),
    )
    trainer.fit(module, loader)
    assert guard.rollbacks == 1 and trainer.global_step == STEPS
    return module, trainer, guard, before_guard, after_guard, loader


def starts_of(recorder: Recorder, step: int) -> list[dict[str, Any]]:
    """The snapshots taken at the start of `step` (1-based), in the order the run took it."""
    return [s for s in recorder.starts if s["step"] == step - 1]


def assert_same_tree(got: Any, expected: Any, where: str) -> None:
    """Nested dicts/lists/tuples of tensors and plain values, equal bit for bit (tensors: torch.equal)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, where
        assert torch.equal(got, expected), f"{where} differs (max |diff| {(got - expected).abs().max()})"
    elif isinstance(expected, np.ndarray):
        assert np.array_equal(got, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert sorted(got, key=str) == sorted(expected, key=str), (
            f"{where}: keys {list(got)} vs {list(expected)}"
        )
        for k in expected:
            assert_same_tree(got[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), f"{where}: length {len(got)} vs {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_same_tree(g, e, f"{where}[{i}]")
    else:
        assert got == expected, f"{where}: {got!r} vs {expected!r}"


def first_and_rolled_back(after_guard: Recorder) -> tuple[dict[str, Any], dict[str, Any]]:
    """Step 5's start the first time (the state the step-4 checkpoint holds) and after the rollback."""
    taken = starts_of(after_guard, RESTORED_STEP + 1)
    assert len(taken) == 2, f"step {RESTORED_STEP + 1} was started {len(taken)} time(s), expected 2"
    return taken[0], taken[1]


def test_the_rollback_goes_back_to_the_checkpoint_before_the_bad_steps(rolled_back):
    _, _, _, before_guard, after_guard, _ = rolled_back
    # the end of step 7: just before the guard rolled back, and just after
    at = next(i for i, s in enumerate(before_guard.ends) if s["step"] == POISONED[-1])
    before, after = before_guard.ends[at], after_guard.ends[at]
    assert after["step"] == RESTORED_STEP
    # the test means something: the live state at the rollback differs from the checkpoint's in every part
    first, _ = first_and_rolled_back(after_guard)
    assert not all(torch.equal(a, b) for a, b in zip(before["params"], first["params"], strict=True))
    moments = before["optimizer"]["state"][0], first["optimizer"]["state"][0]
    assert not torch.equal(moments[0]["exp_avg"], moments[1]["exp_avg"])
    assert moments[0]["step"].item() == RESTORED_STEP + 1 and moments[1]["step"].item() == RESTORED_STEP
    assert not torch.equal(before["torch_rng"], first["torch_rng"])  # dropout drew in steps 5-7
    assert before["lr"] != first["lr"]


def test_the_rollback_restores_the_weights_bit_for_bit(rolled_back):
    _, _, _, _, after_guard, _ = rolled_back
    first, again = first_and_rolled_back(after_guard)
    assert_same_tree(again["params"], first["params"], "parameters")


def test_the_rollback_restores_the_adamw_state_bit_for_bit(rolled_back):
    _, _, _, _, after_guard, _ = rolled_back
    first, again = first_and_rolled_back(after_guard)
    assert sorted(first["optimizer"]["state"]) == list(range(4))  # every parameter has moments
    for state in first["optimizer"]["state"].values():
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
    # exp_avg, exp_avg_sq and step of every parameter, and the param groups (lr, betas, ...)
    assert_same_tree(again["optimizer"], first["optimizer"], "optimizer.state_dict()")


def test_the_rollback_rewinds_the_step_and_the_lr_schedule(rolled_back):
    _, trainer, _, _, after_guard, _ = rolled_back
    first, again = first_and_rolled_back(after_guard)
    assert again["step"] == first["step"] == RESTORED_STEP, f"global_step {again['step']} after the rollback"
    assert again["scheduler_step"] == first["scheduler_step"] == RESTORED_STEP, (
        f"the LR schedule is at step {again['scheduler_step']} after the rollback, not {RESTORED_STEP}"
    )
    assert again["lr"] == first["lr"], "the LR after the rollback is not the one of step 5"  # exactly
    # and from there it follows the schedule again: every step's LR is the one of the first pass
    for step in range(RESTORED_STEP + 1, POISONED[-1] + 1):
        firsts, agains = starts_of(after_guard, step)
        assert agains["lr"] == firsts["lr"] and agains["scheduler_step"] == firsts["scheduler_step"]
    assert trainer.global_step == STEPS and trainer.lr_scheduler.last_epoch == STEPS


def test_the_rollback_restores_the_rng_bit_for_bit(rolled_back):
    _, _, _, _, after_guard, _ = rolled_back
    first, again = first_and_rolled_back(after_guard)
    assert torch.equal(again["torch_rng"], first["torch_rng"]), "torch RNG not restored"
    assert again["python_rng"] == first["python_rng"], "python RNG not restored"
    assert_same_tree(list(again["numpy_rng"]), list(first["numpy_rng"]), "numpy RNG")


def test_after_the_rollback_the_data_reads_on_with_the_next_unread_batch(rolled_back):
    module, trainer, _, _, after_guard, loader = rolled_back
    # the epoch's batch order, from the loader itself and the RNG at the epoch's start
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(after_guard.epoch_start_rng)
        order = [idx for idx, _, _ in loader]
    trained = module.trained
    steps = [step for step, _ in trained]
    expected_steps = [*range(1, POISONED[-1] + 1), *range(RESTORED_STEP + 1, STEPS + 1)]
    assert steps == expected_steps
    # first pass: batches 0..6 of the epoch; after the rollback, step 5 trains on batch 7, not batch 4
    resumed = len(range(1, POISONED[-1] + 1))
    first_after = trained[resumed][1]
    assert torch.equal(first_after, order[POISONED[-1]]), (
        "the first batch after the rollback is not the next unread one"
    )
    assert not torch.equal(first_after, order[RESTORED_STEP]), (
        "the batch of the checkpoint's next step was replayed"
    )
    for i, (_, idx) in enumerate(trained):
        assert torch.equal(idx, order[i]), (
            f"training step #{i + 1} read {idx.tolist()}, expected batch {i} of the epoch"
        )
    seen = torch.cat([idx for _, idx in trained])
    assert seen.unique().numel() == seen.numel() == len(trained) * BATCH  # no sample read twice
    # the loop's data position was not rewound with the step counter
    first, again = first_and_rolled_back(after_guard)
    assert first["batches_in_epoch"] == RESTORED_STEP and again["batches_in_epoch"] == POISONED[-1]
    assert trainer.state.batches_in_epoch == len(trained) and trainer.current_epoch == 0
