"""DP-SGD's tensor memory against Opacus 1.6 on bench/dpsgd.py's text classifier: the peak of torch's tracked
CPU allocations over two steps (trainer/core/memory_peak.py), which is the same in every run, so the comparison
needs no rounds (on a GPU: the CUDA allocator's peak). Each of our modes holds no more than its Opacus peer
("mixed" against Opacus ghost): ghost held 35.6 MiB to Opacus ghost's 34.4 while it kept the norm layers'
inputs and output gradients to the end of the backward (strategies/privacy/per_sample.py)."""

from __future__ import annotations

import pytest
from helpers import bench_module


@pytest.fixture(scope="module")
def bench():
    return bench_module("dpsgd")


@pytest.mark.filterwarnings("ignore::UserWarning:opacus")
def test_every_mode_holds_no_more_tensors_than_opacus(bench):
    peak = {arm: bench.run(arm, 64, track=True)["tensor_mib"] for arm in (*bench.OURS, *bench.OPACUS)}
    for ours, theirs in bench.PEER.items():
        assert peak[ours] <= peak[theirs], f"{ours} holds {peak[ours]:.2f} MiB, {theirs} {peak[theirs]:.2f}"
