"""`trainer plan --noise-scale`: the warning past the noise scale (and its absence below), the strong-scaling
curve's numbers against McCandlish et al. 2018's formula, the noise scale read from the run folder a
GradientNoiseScale fit wrote, and one-line errors for bad values."""

from __future__ import annotations

import pytest
from helpers import TINY
from noise_scale_problem import measured_noise_scale

from trainer.cli import main
from trainer.loggers import CSVLogger


def plan(capsys, *args: str) -> str:
    assert main(["plan", str(TINY), "--gpus", "8", *args]) == 0
    return capsys.readouterr().out


def curve(out: str) -> dict[int, list[float]]:
    """GPUs -> (batch, tokens/s, steps, examples, time, GPU-h) of the printed curve; the planned row is keyed
    by its count (its mark dropped)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("strong scaling at B_noise")) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        gpus, *values = line.split()
        rows[int(gpus.rstrip("*"))] = [float(v.replace(",", "")) for v in values]
    return rows


def test_a_batch_far_beyond_the_noise_scale_is_warned_and_the_curve_follows_the_formula(capsys):
    out = plan(capsys, "--noise-scale", "2")  # the tiny recipe's global batch: 8 sequences, 4x B_noise
    warning = next(line for line in out.splitlines() if line.startswith("warning:"))
    assert "the global batch of 8 sequences is 4.0x the noise scale B_noise = 2 (given)" in warning
    rows = curve(out)
    assert sorted(rows) == [1, 2, 4, 8, 16, 32, 64]
    # printed to 2 decimals: within half a unit (and a float's rounding) of the formula
    noise, planned = 2.0, rows[8]
    for gpus, (batch, tokens_per_s, steps, examples, time, cost) in rows.items():
        assert batch == 8 * gpus / 8, "each GPU keeps the planned run's share of the batch"
        assert steps == pytest.approx((1 + noise / batch) / (1 + noise / planned[0]), abs=6e-3)
        assert examples == pytest.approx((1 + batch / noise) / (1 + planned[0] / noise), abs=6e-3)
        expected = (1 + batch / noise) / (1 + planned[0] / noise) * planned[1] / tokens_per_s
        assert time == pytest.approx(expected, abs=6e-3), f"{gpus} GPUs"
        assert cost == pytest.approx(expected * gpus / 8, abs=6e-3), f"{gpus} GPUs"


def test_a_batch_within_twice_the_noise_scale_is_not_warned(capsys):
    out = plan(capsys, "--noise-scale", "4")
    assert "warning:" not in out and "strong scaling at B_noise = 4 " in out
    assert "the batch reaches B_noise at ~4 GPUs" in out


def test_the_noise_scale_is_read_from_the_run_folder_gradient_noise_scale_wrote(capsys, tmp_path):
    root = tmp_path / "run"
    got = measured_noise_scale(root, 40, 4, 64, logger=CSVLogger(save_dir=root))
    assert list(root.rglob("metrics.csv")), "the CSV logger's file holds the noise scale too"
    out = plan(capsys, "--noise-scale", str(root))
    assert f"B_noise = {got['noise_scale']:,.0f} " in out and "the last noise_scale in " in out


@pytest.mark.parametrize("value", ["0", "-1", "nan", "no-such-run"])
def test_bad_noise_scale_values_are_one_line_errors(capsys, value):
    assert main(["plan", str(TINY), "--gpus", "8", "--noise-scale", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"trainer: error: --noise-scale {value}") and "allowed: a number > 0" in err
    assert "\n" not in err
