"""bench/fault_tolerance.py: --widths (some of its widths, each fit's configuration at the widths it runs) and its
table's ratios (of the arms' medians; each round's, and their median)."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
from helpers import REPO, bench_module


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(REPO / "bench"))  # (its sibling thread_cpu.py, as when run as a script)
    try:
        yield bench_module("fault_tolerance")
    finally:
        sys.path.remove(str(REPO / "bench"))


def test_widths_are_some_of_the_benchs_own(bench):
    assert bench.widths_arg("1024,16") == (1024, 16)
    assert bench.widths_arg("64") == (64,)  # fp16's ~10 ms step here, on request
    for text in ("17", "16,abc", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="allowed: some of 16,64,256,1024"):
            bench.widths_arg(text)


def test_configurations_past_plain_run_at_every_width_but_the_smallest(bench):
    assert bench.fits("plain,tokens", (16, 1024)) == [("plain", 16), ("plain", 1024), ("tokens", 1024)]
    assert bench.fits("tokens", (16,)) == []
    assert bench.fits("fp16", (16, 64)) == [("fp16", 64)]


def test_the_table_gives_each_rounds_ratio_and_their_median(bench, tmp_path, capsys):
    # a load that drifts between rounds: the medians of each arm's times give 1.50, the rounds' own ratios
    # (each arm of a round run next to the other) 1.00 in two rounds of three
    walls = {"ddp": (0.010, 0.020, 0.040), "ft": (0.010, 0.030, 0.040)}
    for name, times in walls.items():
        for r, wall in enumerate(times):
            row = {"wall": wall, "cpu": wall, "p10": wall, **dict.fromkeys(bench.PARTS, 0.0)}
            (tmp_path / f"{name}-{r}-0.json").write_text(json.dumps({"plain/16": row}))
    assert bench.paired(tmp_path, 3, "plain/16") == [1.0, 1.5, 1.0]
    bench.report_steps(tmp_path, 3, "plain", (16,))
    row = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["16"])
    assert row.split()[5] == "1.50"  # the medians' ratio
    assert row.endswith("1.00 1.50 1.00, 1.00")
