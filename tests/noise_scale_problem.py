"""The noise-scale check's problem: linear regression with Gaussian inputs and noise, whose simple noise
scale is known in closed form at the current weights (tests/observability/ and tests/distributed/ measure it
with GradientNoiseScale)."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import SEED, quiet, read_metrics
from torch.utils.data import DataLoader, TensorDataset

from callbacks import GradientNoiseScale
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


def measured_noise_scale(
    root: Path,
    steps: int,
    accumulate: int,
    micro_batch: int,
    module: type | None = None,
    callbacks: tuple = (),
    **trainer_kwargs,
) -> dict:
    """`noise_scale` and the batch sizes of the last logged row of a GradientNoiseScale fit of the regression
    problem (or of `module`, a LinearRegression subclass, with more `callbacks`), `micro_batch` samples per
    micro-batch on each rank."""
    data, weights = regression_problem(SEED)
    torch.manual_seed(SEED)
    loader = DataLoader(data, batch_size=micro_batch, shuffle=True)
    trainer = Trainer(
        max_steps=steps,
        seed=SEED,
        accumulate_grad_batches=accumulate,
        default_root_dir=root,
        enable_checkpointing=False,
        callbacks=[GradientNoiseScale(ema_decay=0.998), *callbacks],
        **quiet(log_every_n_steps=steps, **trainer_kwargs),
    )
    trainer.fit((module or LinearRegression)(weights), loader)
    keys = ("noise_scale", "noise_scale/batch_small", "noise_scale/batch_big")
    return {key: read_metrics(root, key)[steps] for key in keys}
