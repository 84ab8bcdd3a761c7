"""fp16 with a token-weighted loss: the Trainer back-propagates the loss x its token count (a sum), whose
gradients are the count times a mean's. The scaler used to start at its usual 2**16 anyway, so the first
~log2(tokens) steps overflowed and were skipped (a 4096-token batch: 12 of 14 here); it now starts lower by
the smallest power of two from the count, so the sum's scaled gradients are at most a mean's: it skips no
more than a mean. Checked
by SGD against the same module reporting no count (exactly: the scales differ by a power of two), and that a
resumed run keeps its checkpoint's scale."""

from __future__ import annotations

import pytest
import torch
from helpers import TokenCounted, fit, regression_loader

TOKENS, STEPS = 4096, 14


def run(tokens: int | None, root, steps: int = STEPS, **kwargs):
    torch.manual_seed(0)
    module = TokenCounted(tokens)
    trainer = fit(module, regression_loader(8), root, steps, precision="16-mixed", **kwargs)
    return module, trainer


@pytest.mark.parametrize("tokens", [TOKENS, 3000])
def test_a_token_sum_skips_no_more_steps_than_a_mean(tmp_path, tokens):
    mean, mean_trainer = run(None, tmp_path / "mean")
    summed, summed_trainer = run(tokens, tmp_path / "summed")
    assert summed_trainer.state.skipped_steps == mean_trainer.state.skipped_steps == 0
    # the same updates: the count's gradients, unscaled, are the mean's; exactly where the count is a power
    # of two (so is its scale), else to fp16's rounding of the backward's differently scaled values
    exact = tokens & (tokens - 1) == 0
    for got, expected in zip(summed.parameters(), mean.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 if exact else 1e-4)
    # the scale started lower by 2**ceil(log2(tokens)): 2**12 for 4096 and for 3000
    assert summed_trainer.strategy.precision.scaler.get_scale() * 2**12 == (
        mean_trainer.strategy.precision.scaler.get_scale()
    )


def test_a_resumed_run_keeps_its_checkpoints_scale(tmp_path):
    _, first = run(TOKENS, tmp_path, steps=4, enable_checkpointing=True)
    saved = first.strategy.precision.scaler.get_scale()
    _, resumed = run(TOKENS, tmp_path, steps=6, ckpt_path="last")
    assert resumed.state.global_step == 6
    assert resumed.state.skipped_steps == first.state.skipped_steps
    assert resumed.strategy.precision.scaler.get_scale() == saved  # not lowered again
