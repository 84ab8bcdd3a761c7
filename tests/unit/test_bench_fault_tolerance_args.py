"""bench/fault_tolerance.py's --widths: some of its widths, each fit's configuration at the widths it runs."""

from __future__ import annotations

import argparse
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
    for text in ("17", "16,abc", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="allowed: some of 16,256,1024"):
            bench.widths_arg(text)


def test_configurations_past_plain_run_at_the_two_larger_widths_only(bench):
    assert bench.fits("plain,tokens", (16, 1024)) == [("plain", 16), ("plain", 1024), ("tokens", 1024)]
    assert bench.fits("tokens", (16,)) == []
