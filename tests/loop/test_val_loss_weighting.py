"""val/loss is the mean over the examples (or the tokens, when the step returns num_tokens) of the whole
validation set, as Hugging Face's Trainer and Lightning weigh it: a short last batch weighs as its size."""

from __future__ import annotations

import torch
from helpers import Regression, quiet, regression_data
from torch.utils.data import DataLoader

from trainer import Trainer


def test_val_loss_is_the_mean_over_examples_not_over_batches(tmp_path):
    data = regression_data(9)  # batches of 4, 4 and 1
    module = Regression()
    got = Trainer(default_root_dir=tmp_path, **quiet()).validate(module, DataLoader(data, batch_size=4))
    x, y = data.tensors
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(module(x), y).item()
    assert abs(got["val/loss"] - expected) < 1e-6, (got["val/loss"], expected)


class TokenLoss(Regression):
    """A loss that is the mean over the batch's "tokens": its examples x a per-batch token count."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        tokens = 3 * len(x) if batch_idx == 0 else 1  # the first batch carries most of the tokens
        return {"loss": torch.nn.functional.mse_loss(self(x), y), "num_tokens": tokens}


def test_val_loss_is_token_weighted_when_the_step_returns_num_tokens(tmp_path):
    data = regression_data(8)
    module = TokenLoss()
    got = Trainer(default_root_dir=tmp_path, **quiet()).validate(module, DataLoader(data, batch_size=4))
    x, y = data.tensors
    with torch.no_grad():
        first = torch.nn.functional.mse_loss(module(x[:4]), y[:4]).item()
        second = torch.nn.functional.mse_loss(module(x[4:]), y[4:]).item()
    assert abs(got["val/loss"] - (12 * first + 1 * second) / 13) < 1e-6
