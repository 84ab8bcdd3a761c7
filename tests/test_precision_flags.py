"""`precision`: Lightning's aliases pick the same mode as the canonical names, and the `Precision` object a
custom strategy is configured with autocasts on the CPU by default and says whether a step was applied."""

from __future__ import annotations

import pytest
import torch
from helpers import Regression, fit, read_metrics, regression_loader

from callbacks import Callback
from trainer.precision import Precision


class RecordsDtype(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.dtypes.append(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), y)


@pytest.mark.parametrize(
    "precision, dtype",
    [
        ("bf16", torch.bfloat16),
        (16, torch.float16),
        ("16", torch.float16),
        ("32-true", torch.float32),
        ("fp32", torch.float32),
    ],
)
def test_lightning_precision_aliases_run_in_their_dtype(tmp_path, precision, dtype):
    module = RecordsDtype()
    fit(module, regression_loader(), tmp_path, 2, precision=precision, enable_checkpointing=False)
    assert module.dtypes == [dtype, dtype]


def test_a_precision_without_a_device_type_autocasts_on_the_cpu():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with Precision("bf16-mixed").autocast():
        assert (a @ b).dtype == torch.bfloat16


def sgd_step(precision: Precision, grad: float) -> tuple[bool, torch.Tensor]:
    """One step of a parameter at 1.0 whose gradient is `grad` (through the precision's scaling)."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    precision.backward((p * grad).sum())
    precision.unscale_gradients(opt)
    applied = precision.optimizer_step(opt)
    return applied, p.detach()


@pytest.mark.parametrize("name", ["32", "bf16-mixed", "16-mixed"])
def test_optimizer_step_says_the_update_was_applied(name):
    applied, value = sgd_step(Precision(name), 1.0)
    assert applied is True
    assert torch.equal(value, torch.full((2,), 0.5))


def test_an_fp16_step_with_inf_gradients_is_skipped_and_says_so():
    applied, value = sgd_step(Precision("16-mixed"), float("inf"))
    assert applied is False
    assert torch.equal(value, torch.ones(2))


class OverflowsAt(Regression):
    """Step `step`'s loss is huge: finite in fp32, but its fp16-scaled gradients overflow, as an fp16 run's
    now and then do."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.calls = step, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        loss = super().training_step(batch, batch_idx)
        return loss * 1e30 if self.calls == self.step else loss


def test_an_fp16_step_the_loss_scaler_drops_is_counted_as_skipped(tmp_path):
    """No NaNGuard: the GradScaler alone drops step 3's update; the run says so and does not count it as
    productive training."""
    kept = []
    trainer = fit(
        OverflowsAt(3),
        regression_loader(),
        tmp_path,
        5,
        precision="16-mixed",
        callbacks=[Recorder(kept)],
        enable_checkpointing=False,
    )
    assert trainer.state.skipped_steps == 1, kept
    assert read_metrics(tmp_path, "train/skipped_steps")[5] == 1
    assert kept == [False, False, True, False, False]  # outputs["skipped"] of each step


class Recorder(Callback):
    def __init__(self, kept: list) -> None:
        self.kept = kept

    def on_train_batch_end(self, trainer, module, outputs):
        self.kept.append(outputs["skipped"])
