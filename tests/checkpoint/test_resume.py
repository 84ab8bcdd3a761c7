"""Interrupt-and-resume continues exactly: same losses, same final parameters as an uninterrupted run."""

from pathlib import Path

import pytest
import torch
from helpers import Regression, TinyLM, quiet, read_metrics, regression_loader, tiny_lm_loader

from callbacks import Callback, ModelCheckpoint
from trainer import Trainer


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt(f"simulated interruption at step {self.step}")


def run(module_fn, loader_fn, root: Path, crash_at: int | None = None, ckpt_path=None, **kwargs):
    torch.manual_seed(0)
    module = module_fn()
    callbacks = [CrashAt(crash_at)] if crash_at else []
    trainer = Trainer(
        max_steps=20,
        seed=0,
        default_root_dir=root,
        callbacks=[*callbacks, ModelCheckpoint(every_n_steps=5)],
        lr_schedule="cosine",
        warmup_steps=3,
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
        **quiet(**kwargs),
    )
    trainer.fit(module, loader_fn(), ckpt_path=ckpt_path)
    return module


def assert_resume_matches(module_fn, loader_fn, tmp_path, **kwargs):
    straight = run(module_fn, loader_fn, tmp_path / "straight", **kwargs)
    with pytest.raises(KeyboardInterrupt):
        run(module_fn, loader_fn, tmp_path / "resumed", crash_at=12, **kwargs)
    assert read_metrics(tmp_path / "resumed").keys() == set(range(1, 13))
    resumed = run(module_fn, loader_fn, tmp_path / "resumed", ckpt_path="last", **kwargs)
    expected, got = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert list(got) == list(range(1, 21)), (
        "steps after the checkpoint must be re-logged once, not duplicated"
    )
    diverged = [(s, expected[s], got[s]) for s in expected if expected[s] != got[s]]
    assert not diverged, f"first divergence (step, straight, resumed): {diverged[:1]}"
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), f"parameter {name} differs after resume"


def test_resume_with_shuffled_dataloader_and_dropout_continues_exactly(tmp_path):
    # 256 samples / 16 = 16 micro-batches per epoch = 8 steps: the run crosses two epoch boundaries
    assert_resume_matches(
        lambda: Regression(dropout=0.2), lambda: regression_loader(batch_size=16, shuffle=True), tmp_path
    )


def test_resume_with_stateful_token_loader_continues_exactly(tmp_path):
    # 124 blocks / 8 = 15 micro-batches per epoch: windows straddle epoch ends
    assert_resume_matches(TinyLM, tiny_lm_loader, tmp_path)


def test_resume_with_fp16_scaler_restores_its_scale(tmp_path):
    assert_resume_matches(
        Regression, lambda: regression_loader(batch_size=16, shuffle=True), tmp_path, precision="16-mixed"
    )


def test_last_with_no_checkpoint_starts_from_scratch(tmp_path, caplog):
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(
        Regression(), regression_loader(), ckpt_path="last"
    )
    assert read_metrics(tmp_path).keys() == {1, 2}


def test_resume_extends_a_finished_run_with_more_steps(tmp_path):
    Trainer(max_steps=4, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    t = Trainer(max_steps=6, default_root_dir=tmp_path, **quiet())
    t.fit(Regression(), regression_loader(), ckpt_path="last")
    assert t.global_step == 6
    assert list(read_metrics(tmp_path)) == [1, 2, 3, 4, 5, 6]


def test_deterministic_applies_during_the_run_and_is_restored_after(tmp_path):
    seen = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(torch.are_deterministic_algorithms_enabled())

    assert not torch.are_deterministic_algorithms_enabled()
    Trainer(max_steps=2, deterministic=True, callbacks=[Probe()], default_root_dir=tmp_path, **quiet()).fit(
        Regression(), regression_loader()
    )
    assert seen == [True, True]
    assert not torch.are_deterministic_algorithms_enabled()
