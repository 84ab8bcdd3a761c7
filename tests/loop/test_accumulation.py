"""Gradient accumulation equals one large batch, also for token-mean losses with uneven token counts."""

import pytest
import torch
from helpers import Regression, TokenMeanLM, fit, params, quiet, regression_loader, uneven_token_data
from torch.utils.data import DataLoader

from trainer import Trainer


def fit_params(module, loader, root, **kwargs):
    fit(module, loader, root, 6, enable_checkpointing=False, **kwargs)
    return params(module)


def test_accumulating_four_micro_batches_equals_one_batch_four_times_larger(tmp_path):
    """With SGD: AdamW's update hides a constant factor, such as micro-batch losses summed, not averaged."""
    torch.manual_seed(0)
    big = fit_params(Regression(optimizer="sgd"), regression_loader(batch_size=32), tmp_path / "a")
    torch.manual_seed(0)
    acc = fit_params(
        Regression(optimizer="sgd"),
        regression_loader(batch_size=8),
        tmp_path / "b",
        accumulate_grad_batches=4,
    )
    for a, b in zip(big, acc, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_token_weighted_accumulation_equals_one_large_batch_with_uneven_token_counts(tmp_path):
    data = uneven_token_data()
    torch.manual_seed(0)
    big = fit_params(TokenMeanLM(), DataLoader(data, batch_size=16), tmp_path / "a")
    torch.manual_seed(0)
    acc = fit_params(TokenMeanLM(), DataLoader(data, batch_size=4), tmp_path / "b", accumulate_grad_batches=4)
    for a, b in zip(big, acc, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_without_num_tokens_uneven_micro_batches_weigh_equally_and_differ_from_one_batch(tmp_path):
    """The control for the test above: the data really is uneven enough to matter."""
    data = uneven_token_data()
    torch.manual_seed(0)
    big = fit_params(TokenMeanLM(report_tokens=False), DataLoader(data, batch_size=16), tmp_path / "a")
    torch.manual_seed(0)
    acc = fit_params(
        TokenMeanLM(report_tokens=False),
        DataLoader(data, batch_size=4),
        tmp_path / "b",
        accumulate_grad_batches=4,
    )
    assert max((a - b).abs().max().item() for a, b in zip(big, acc, strict=True)) > 1e-4


def test_last_partial_window_of_an_epoch_steps_with_what_is_left(tmp_path):
    """10 micro-batches with accumulation 4 -> steps of 4, 4 and 2 micro-batches per epoch."""
    steps = []

    class Count(Regression):
        def on_fit_end(self):
            steps.append(self.global_step)

    Trainer(max_epochs=2, default_root_dir=tmp_path, accumulate_grad_batches=4, **quiet()).fit(
        Count(), regression_loader(batch_size=8, n=80)
    )
    assert steps == [6]


@pytest.mark.parametrize(
    "precision, compute_dtype",
    [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16), ("bf16-true", torch.bfloat16)],
)
def test_reduced_precision_runs_on_cpu_in_that_dtype_and_reduces_the_loss(tmp_path, precision, compute_dtype):
    from helpers import read_metrics

    seen = set()

    class Recording(Regression):
        def training_step(self, batch, batch_idx):
            seen.add(self.net(batch[0]).dtype)
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    trainer = Trainer(
        max_steps=60, precision=precision, default_root_dir=tmp_path, enable_checkpointing=False, **quiet()
    )
    trainer.fit(Recording(lr=3e-3), regression_loader(batch_size=32, shuffle=True))
    assert seen == {compute_dtype}
    if precision == "16-mixed":
        assert trainer.strategy.precision.scaler.get_scale() > 1.0  # the gradient scaler is active
    losses = read_metrics(tmp_path)
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(56, 61)) / 5
    assert last < 0.5 * first, f"{precision}: loss {first:.4f} -> {last:.4f}"
