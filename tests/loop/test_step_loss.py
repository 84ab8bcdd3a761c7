"""The loss a step reports (logged as train/loss, read by callbacks as `step_loss`) is that of all its
micro-batches: their mean, or their token-weighted mean when training_step reports num_tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ScriptedLoss,
    TokenMeanLM,
    fit,
    read_metrics,
    regression_loader,
    uneven_token_data,
)
from torch.utils.data import DataLoader, TensorDataset


def test_an_accumulated_step_logs_the_mean_of_its_micro_batch_losses(tmp_path):
    module = ScriptedLoss([1.0, 2.0, 3.0, 5.0])
    fit(module, regression_loader(n=64), tmp_path, 2, accumulate_grad_batches=2, enable_checkpointing=False)
    assert read_metrics(tmp_path) == {1: 1.5, 2: 4.0}


class RecordedTokens(TokenMeanLM):
    """TokenMeanLM that remembers each micro-batch's loss and valid-token count."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, int]] = []

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.seen.append((out["loss"].item(), int(out["num_tokens"])))
        return out


def test_a_token_weighted_step_logs_the_mean_over_the_tokens_of_its_micro_batches(tmp_path):
    module = RecordedTokens()
    loader = DataLoader(uneven_token_data(), batch_size=4)
    fit(module, loader, tmp_path, 3, accumulate_grad_batches=2, enable_checkpointing=False)
    expected = {}
    for step in (1, 2, 3):
        (l1, n1), (l2, n2) = module.seen[2 * step - 2 : 2 * step]
        assert n1 != n2, "the test needs micro-batches with different token counts"
        expected[step] = (l1 * n1 + l2 * n2) / (n1 + n2)
    assert read_metrics(tmp_path) == pytest.approx(expected, rel=1e-6)


class TokensOnEvenBatches(TokenMeanLM):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return out if batch_idx % 2 == 0 else out["loss"]


def test_num_tokens_from_only_some_micro_batches_of_a_step_is_refused(tmp_path):
    loader = DataLoader(uneven_token_data(), batch_size=4)
    with pytest.raises(ValueError) as error:
        fit(TokensOnEvenBatches(), loader, tmp_path, 2, accumulate_grad_batches=2, enable_checkpointing=False)
    assert str(error.value) == (
        "training_step returned 'num_tokens' for some micro-batches but not others; return it always or never"
    )


class RecordedLoss(TokenMeanLM):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.losses.append(out["loss"].detach())
        return out


def test_under_bf16_true_a_token_weighted_step_logs_its_loss_unrounded(tmp_path):
    """259 valid tokens per step, a count bf16 cannot hold: the logged loss is still the step's own loss
    (its token sum and count are not rounded to bf16 on the way)."""
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 16, (3, 259), generator=g), torch.randint(0, 16, (3, 259), generator=g)
    module = RecordedLoss()
    fit(module, DataLoader(TensorDataset(ids, labels), batch_size=1), tmp_path, 3, precision="bf16-true")
    assert {loss.dtype for loss in module.losses} == {torch.bfloat16}
    assert read_metrics(tmp_path) == {step: float(loss) for step, loss in enumerate(module.losses, 1)}
