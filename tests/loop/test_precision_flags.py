"""`precision`: Lightning's aliases pick the same mode as the canonical names, and the `Precision` object a
custom strategy is configured with autocasts on the CPU by default and says whether a step was applied."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    Regression,
    StopAt,
    TokenMeanLM,
    assert_params_close,
    fit,
    params,
    read_metrics,
    regression_loader,
    uneven_token_data,
)
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback
from trainer import TrainModule
from trainer.core.precision import Precision


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

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.kept.append(outputs["skipped"])


class ScaleProbe(TrainModule):
    """loss = 1.5 * sum of an fp16 linear output: its gradient reaches the fp16 output as 1.5 x the loss
    scale, an fp16 overflow (inf) at the scaler's initial 2**16 and finite from 2**15 on. So a fresh fp16
    run drops exactly its first update, then keeps every one while the scaler remembers the lower scale."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1, bias=False)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return 1.5 * self.lin(x * 1e-3).float().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def fp16_probe_run(root, **kwargs):
    torch.manual_seed(0)
    return fit(ScaleProbe(), regression_loader(), root, 5, precision="16-mixed", **kwargs)


@pytest.mark.filterwarnings(
    "ignore:Detected call of `lr_scheduler.step\\(\\)` before"
)  # the dropped 1st update
def test_a_resumed_fp16_run_keeps_the_loss_scale_it_learned(tmp_path):
    kept = []
    straight = fp16_probe_run(tmp_path / "straight")
    first = fp16_probe_run(tmp_path / "resumed", callbacks=[StopAt(3)])
    assert (first.global_step, first.state.skipped_steps) == (3, 1)  # the first update, dropped
    resumed = fp16_probe_run(tmp_path / "resumed", ckpt_path="last", callbacks=[Recorder(kept)])
    assert kept == [False, False]  # a scale re-learned from 2**16 would drop step 4's update again
    assert resumed.state.skipped_steps == straight.state.skipped_steps == 1
    assert_params_close(params(resumed.module), params(straight.module), atol=0)


@pytest.mark.parametrize("saved, resumed", [("16-mixed", "32"), ("32", "16-mixed")])
def test_a_run_resumes_in_another_precision(tmp_path, saved, resumed):
    """The fp16 loss scaler's state is kept for an fp16 run only: fp32 ignores it, and an fp16 run resumed
    from an fp32 checkpoint starts a fresh scaler."""
    fit(Regression(), regression_loader(), tmp_path, 4, precision=saved, callbacks=[StopAt(2)])
    trainer = fit(Regression(), regression_loader(), tmp_path, 4, precision=resumed, ckpt_path="last")
    assert trainer.global_step == 4 and trainer.state.restarts == 1
    losses = read_metrics(tmp_path)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())


def test_bf16_true_casts_float_inputs_and_keeps_token_ids_integer(tmp_path):
    seen = []

    class Records(TokenMeanLM):
        def training_step(self, batch, batch_idx):
            ids, labels, weights = batch
            seen.append((ids.dtype, labels.dtype, weights.dtype))
            return super().training_step((ids, labels), batch_idx)

    ids, labels = uneven_token_data().tensors
    loader = DataLoader(TensorDataset(ids, labels, torch.rand(len(ids))), batch_size=8)
    fit(Records(), loader, tmp_path, 2, precision="bf16-true", enable_checkpointing=False)
    assert seen == [(torch.int64, torch.int64, torch.bfloat16)] * 2
    assert all(math.isfinite(v) for v in read_metrics(tmp_path).values())
