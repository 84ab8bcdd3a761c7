"""GradientNoiseScale against a closed form: linear regression with Gaussian inputs and noise, where the
per-example gradient's covariance and the true gradient are known at the current weights, measured under
gradient accumulation on one process (the 2-process DDP check: tests/distributed/); and its one-line
refusals where it cannot measure."""

from __future__ import annotations

import pytest
import torch
from helpers import SEED, quiet, read_metrics
from torch.utils.data import DataLoader, TensorDataset

from callbacks import GradientNoiseScale
from strategies import DPSGDStrategy
from trainer import Trainer, TrainModule

DIM, NOISE_STD, OFFSET = 64, 0.5, 1.0  # d, sigma, |delta| = |w - w*|
EXAMPLES = 16384


def closed_form_noise_scale(dim: int, noise_std: float, offset: float) -> float:
    """B_simple = tr(Sigma) / |G|^2 for the loss 1/2 (x.w - y)^2 with x ~ N(0, I_d), y = x.w* + eps,
    eps ~ N(0, sigma^2), at weights w = w* + delta.

    One example's gradient is g = x (x.delta - eps), so the true gradient is G = E[x x^T] delta = delta.
    Its second moment is E[g g^T] = E[(x.delta)^2 x x^T] + sigma^2 E[x x^T] = |delta|^2 I + 2 delta delta^T
    + sigma^2 I (Isserlis' theorem for the fourth moments of a Gaussian), so
    tr(Sigma) = tr(E[g g^T]) - |G|^2 = (d + 1) |delta|^2 + d sigma^2 and
    B_simple = (d + 1) + d sigma^2 / |delta|^2. (Scaling the loss scales G and Sigma alike: no change.)"""
    return (dim + 1) + dim * noise_std**2 / offset**2


def regression_problem(seed: int) -> tuple[TensorDataset, torch.Tensor]:
    """EXAMPLES draws of (x, y) and the weights w* + delta, |delta| = OFFSET, where the closed form holds."""
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(DIM, generator=gen)
    x = torch.randn(EXAMPLES, DIM, generator=gen)
    y = x @ w_true + NOISE_STD * torch.randn(EXAMPLES, generator=gen)
    delta = torch.randn(DIM, generator=gen)
    return TensorDataset(x, y), w_true + OFFSET * delta / delta.norm()


class LinearRegression(TrainModule):
    """y ~ x.w without bias, loss 1/2 squared error; SGD at lr 0 holds the weights where the closed form
    was taken, so every step estimates the same noise scale."""

    def __init__(self, weights: torch.Tensor) -> None:
        super().__init__()
        self.net = torch.nn.Linear(DIM, 1, bias=False)
        with torch.no_grad():
            self.net.weight.copy_(weights.reshape(1, -1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return 0.5 * (self.net(x).squeeze(-1) - y).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def measured_noise_scale(root, steps: int, accumulate: int, micro_batch: int, **trainer_kwargs) -> dict:
    """The last logged row of a GradientNoiseScale fit of the regression problem."""
    data, weights = regression_problem(SEED)
    torch.manual_seed(SEED)
    loader = DataLoader(data, batch_size=micro_batch, shuffle=True)
    trainer = Trainer(
        max_steps=steps,
        seed=SEED,
        accumulate_grad_batches=accumulate,
        default_root_dir=root,
        enable_checkpointing=False,
        callbacks=[GradientNoiseScale(ema_decay=0.998)],
        **quiet(log_every_n_steps=steps, **trainer_kwargs),
    )
    trainer.fit(LinearRegression(weights), loader)
    keys = ("noise_scale", "noise_scale/batch_small", "noise_scale/batch_big")
    return {key: read_metrics(root, key)[steps] for key in keys}


def test_noise_scale_under_accumulation_is_within_20_percent_of_the_closed_form(tmp_path):
    expected = closed_form_noise_scale(DIM, NOISE_STD, OFFSET)
    got = measured_noise_scale(tmp_path, steps=300, accumulate=4, micro_batch=64)
    assert (got["noise_scale/batch_small"], got["noise_scale/batch_big"]) == (64, 256)
    error = got["noise_scale"] / expected - 1
    assert abs(error) < 0.2, f"seed {SEED}: B_simple {got['noise_scale']:.1f} vs closed form {expected:.1f}"


def test_one_process_without_accumulation_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=1\); allowed") as err:
        measured_noise_scale(tmp_path, steps=1, accumulate=1, micro_batch=8)
    assert "\n" not in str(err.value)


def test_dp_sgd_is_refused_in_one_line(tmp_path):
    strategy = DPSGDStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="DPSGDStrategy clips every per-sample gradient") as err:
        measured_noise_scale(tmp_path, steps=1, accumulate=1, micro_batch=8, strategy=strategy)
    assert "\n" not in str(err.value)


def test_bad_ema_decay_is_refused():
    with pytest.raises(ValueError, match=r"ema_decay=1\.0 is invalid; allowed: 0 <= ema_decay < 1"):
        GradientNoiseScale(ema_decay=1.0)
