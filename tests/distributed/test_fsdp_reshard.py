"""FSDPStrategy's ZeRO stages as FSDP2 runs them on 2 gloo ranks: ZeRO-2 keeps each block's parameters
gathered from its forward to its backward (reshard_after_forward=False: memory for speed), ZeRO-3 frees
them after the forward and gathers again for the backward; both hold only their shard after the backward."""

from __future__ import annotations

import json

import pytest
from helpers import SCRIPTS, run_ranks

pytestmark = pytest.mark.slow

WHOLE, SHARD = [8, 8], [4, 8]  # a block's Linear(8, 8) weight, whole and as one of 2 ranks' row shards


def test_zero2_keeps_blocks_gathered_between_forward_and_backward_and_zero3_does_not(tmp_path):
    out = tmp_path / "report.json"
    run_ranks(2, SCRIPTS / "fsdp_reshard_script.py", "--root", str(tmp_path), "--out", str(out), timeout=300)
    report = json.loads(out.read_text())
    assert report["2"]["after_forward"] == [[WHOLE, WHOLE]] * 2
    assert report["3"]["after_forward"] == [[SHARD, SHARD]] * 2
    for stage in ("2", "3"):
        assert report[stage]["after_backward"] == [[SHARD, SHARD]] * 2, stage
