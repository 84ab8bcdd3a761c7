"""Sequence parallelism keeps the shard of the gathered norm outputs for the projections' backward
(trainer/models/sequence_gather.py): a tp=2 block keeps half of each, and trains bit for bit as with
torch's PrepareModuleInput, which keeps the gathered sequence (tests/scripts/sequence_gather_script.py)."""

from __future__ import annotations

import json

import pytest
from helpers import SCRIPTS, run_ranks

pytestmark = pytest.mark.slow


def test_a_tp2_block_keeps_half_of_its_two_norm_outputs_and_the_same_gradients(tmp_path):
    out = tmp_path / "out.json"
    run_ranks(2, SCRIPTS / "sequence_gather_script.py", "--out", str(out), torchrun=True)
    result = json.loads(out.read_text())
    assert result["equal"], "gradients differ from PrepareModuleInput's"
    # two norm outputs (attention, feed-forward) of bf16 over every token, half of each on this rank
    half_of_two = 2 * result["tokens"] * result["dim"] * 2 // 2
    saved = result["kept"]["gathered"] - result["kept"]["shard"]
    assert saved == pytest.approx(half_of_two, rel=0.02), result
