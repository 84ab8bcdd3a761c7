"""strategies/plan/scaling.py: McCandlish et al. 2018's step/example trade-off, the warning past the noise
scale, the strong-scaling curve's numbers against the formula, and reading --noise-scale."""

from __future__ import annotations

import json
import math

import pytest

from strategies.plan.scaling import (
    ScalingPoint,
    batch_warning,
    gpu_counts,
    read_noise_scale,
    relative_time,
    scaling_lines,
    strong_scaling,
)


def test_the_warning_appears_only_past_twice_the_noise_scale():
    assert batch_warning(512, 256, "given") is None
    line = batch_warning(2048, 256, "given")
    # B = 8 B_noise: S/S_min = 1 + 1/8, E/E_min = 1 + 8; against a batch of B_noise (both 2): 4.5x fewer
    # examples in 2 / 1.125 = 1.78x the steps
    assert line.startswith(
        "warning: the global batch of 2,048 sequences is 8.0x the noise scale B_noise = 256"
    )
    assert "S/S_min = 1 + B_noise/B = 1.12" in line and "E/E_min = 1 + B/B_noise = 9.00" in line
    assert "4.5x fewer examples (compute) in 1.78x the steps" in line and "\n" not in line


def test_gpu_counts_are_powers_of_two_around_the_planned_count():
    assert gpu_counts(64) == [8, 16, 32, 64, 128, 256, 512]
    assert gpu_counts(6) == [1, 2, 4, 6, 8, 16, 32]
    assert gpu_counts(1) == [1, 2, 4, 8]


def test_the_curve_follows_the_step_example_trade_off():
    noise = 96.0
    # a planner whose throughput grows as sqrt(GPUs): 1000 tokens/s on one GPU
    points = strong_scaling(lambda gpus, batch: 1000.0 * math.sqrt(gpus), 8, 64, [4, 8, 16])
    assert [(p.gpus, p.global_batch) for p in points] == [(4, 32), (8, 64), (16, 128)]
    planned = points[1]
    for p in points:
        # time = examples needed / examples per second, relative to the planned run's
        examples = (1 + p.global_batch / noise) / (1 + planned.global_batch / noise)
        expected = examples * math.sqrt(8) / math.sqrt(p.gpus)
        assert relative_time(p, planned, noise) == pytest.approx(expected, rel=1e-12)
    lines = scaling_lines(points, 8, noise)
    row = next(line for line in lines if line.split()[0] == "16")
    steps, examples, time, cost = (float(x) for x in row.split()[-4:])
    assert steps == pytest.approx((1 + noise / 128) / (1 + noise / 64), abs=5e-3)
    assert examples == pytest.approx((1 + 128 / noise) / (1 + 64 / noise), abs=5e-3)
    exact_time = (1 + 128 / noise) / (1 + 64 / noise) * math.sqrt(8 / 16)
    assert time == pytest.approx(exact_time, abs=5e-3)
    assert cost == pytest.approx(exact_time * 16 / 8, abs=5e-3)  # GPU-hours: time x GPUs
    assert lines[-1].startswith("the batch reaches B_noise at ~12 GPUs")  # 8 x 96 / 64


def test_a_count_where_no_layout_fits_is_shown_without_a_time():
    def planner(gpus: int, batch: int) -> float:
        if gpus < 8:
            raise ValueError("no layout fits")
        return 1000.0 * gpus

    points = strong_scaling(planner, 8, 64, [4, 8])
    assert points[0] == ScalingPoint(4, 32, None, "no layout fits")
    row = scaling_lines(points, 8, 100.0)[2]
    assert "no layout fits" in row and row.split()[-2:] == ["-", "-"]


def test_noise_scale_is_read_from_a_number_a_metrics_file_or_a_run_folder(tmp_path):
    assert read_noise_scale("256") == (256.0, "given")
    jsonl = tmp_path / "run" / "logs" / "metrics.jsonl"
    jsonl.parent.mkdir(parents=True)
    rows = [
        {"step": 10, "noise_scale": 90.0},
        {"step": 20, "noise_scale": 120.0},
        {"step": 30, "train/loss": 1},
    ]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_noise_scale(str(jsonl)) == (120.0, f"the last noise_scale in {jsonl}")
    assert read_noise_scale(str(tmp_path / "run"))[0] == 120.0
    csv = tmp_path / "metrics.csv"  # CSVLogger's prefix is joined with "-"
    csv.write_text("epoch,pre-noise_scale,step\n0,70.5,10\n0,,20\n")
    assert read_noise_scale(str(csv))[0] == 70.5


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "missing.csv"])
def test_bad_noise_scale_values_are_one_line_errors_naming_the_flag(value, tmp_path):
    with pytest.raises(ValueError) as err:
        read_noise_scale(value if value != "missing.csv" else str(tmp_path / value))
    message = str(err.value)
    assert message.startswith("--noise-scale ") and "allowed: a number > 0" in message and "\n" not in message


def test_a_metrics_file_without_a_noise_scale_is_an_error(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,train/loss\n0,1,2.5\n")
    with pytest.raises(ValueError, match="the file holds no noise_scale value; allowed"):
        read_noise_scale(str(path))
    with pytest.raises(ValueError, match="no metrics file under it holds a noise_scale value; allowed"):
        read_noise_scale(str(tmp_path))
