"""GradientNoiseScale against a closed form (tests/noise_scale_problem.py) under gradient accumulation on one
process (2-process DDP: tests/distributed/test_gradient_noise_scale_ddp.py), and its one-line refusals where
it cannot measure."""

from __future__ import annotations

import pytest
from helpers import SEED
from noise_scale_problem import (
    DIM,
    NOISE_STD,
    OFFSET,
    LinearRegression,
    closed_form_noise_scale,
    measured_noise_scale,
)

from callbacks import GradientNoiseScale
from strategies import DPSGDStrategy


def test_noise_scale_under_accumulation_is_within_20_percent_of_the_closed_form(tmp_path):
    expected = closed_form_noise_scale(DIM, NOISE_STD, OFFSET)
    got = measured_noise_scale(tmp_path, steps=300, accumulate=4, micro_batch=64)
    assert (got["noise_scale/batch_small"], got["noise_scale/batch_big"]) == (64, 256)
    error = got["noise_scale"] / expected - 1
    assert abs(error) < 0.2, f"seed {SEED}: B_simple {got['noise_scale']:.1f} vs closed form {expected:.1f}"


class TokenWeighted(LinearRegression):
    """The same loss returned with a token count (one per sample): back-propagated as a token sum, so a
    micro-batch's gradient enters `.grad` weighted by its count instead of 1/accumulation."""

    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx), "num_tokens": batch[0].shape[0]}


class Manual(LinearRegression):
    def __init__(self, weights) -> None:
        super().__init__(weights)
        self.automatic_optimization = False


def test_a_token_weighted_loss_gives_the_same_estimate(tmp_path):
    """The weight each micro-batch's loss enters the backward with is read from the gradient reaching it."""
    mean = measured_noise_scale(tmp_path / "mean", steps=20, accumulate=2, micro_batch=64)
    tokens = measured_noise_scale(
        tmp_path / "tokens", steps=20, accumulate=2, micro_batch=64, module=TokenWeighted
    )
    assert tokens == pytest.approx(mean, rel=1e-9)


def test_manual_optimization_is_refused_in_one_line(tmp_path):
    with pytest.raises(
        ValueError, match=r"Manual optimizes manually .*; allowed: automatic_optimization=True"
    ):
        measured_noise_scale(tmp_path, steps=1, accumulate=1, micro_batch=8, module=Manual)


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
