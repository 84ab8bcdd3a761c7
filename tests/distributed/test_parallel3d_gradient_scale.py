"""Parallel3DStrategy's gradient is that of the step's mean loss, with no constant factor on it: every run
here uses SGD (AdamW and clipping below the norm hide a constant factor; SGD's update shows it) and must
match one process step by step in `train/grad_norm` and in the final weights. A pipeline loss without a
token count weighs each of the schedule's micro-batches 1/m, also under gradient accumulation; clipping
at a threshold above the norm leaves the gradients as they are, under FSDP and tensor parallelism."""

from __future__ import annotations

import functools

import pytest
from helpers import launch_layouts, reference_run
from parallel3d_script import make_run
from test_parallel3d import SCRIPT, STEPS, assert_trains_like_one_process

CLIP = 100.0  # far above these runs' gradient norms (~3): clipping must leave the gradients alone
SCALAR_SGD = {"scalar_sgd": True, "clip": None}
LAYOUTS = [
    {"tag": "pp2-scalar-loss-2-microbatches", "pp": 2, **SCALAR_SGD},
    {"tag": "pp2-scalar-loss-4-microbatches", "pp": 2, "microbatches": 4, **SCALAR_SGD},
    {"tag": "pp2-scalar-loss-accumulate2", "pp": 2, "accumulate": 2, **SCALAR_SGD},
    {"tag": "fsdp2-clip-above-norm", **SCALAR_SGD, "clip": CLIP},
    {"tag": "tp2-clip-above-norm", "tp": 2, **SCALAR_SGD, "clip": CLIP},
]


@pytest.mark.slow
def test_scalar_pipeline_losses_and_clipping_above_the_norm_give_one_process_gradients(tmp_path):
    reference = reference_run(functools.partial(make_run, **SCALAR_SGD), tmp_path / "reference", STEPS, 8)
    norms = reference[1]
    assert max(norms.values()) < CLIP / 10, f"the test needs norms far below the clip value: {norms}"
    results = launch_layouts(SCRIPT, tmp_path, 2, LAYOUTS, STEPS)
    failures = []
    for layout in LAYOUTS:  # every layout's verdict, not only the first failure's
        try:
            assert_trains_like_one_process(tmp_path, layout["tag"], results[layout["tag"]], reference)
        except AssertionError as error:
            failures.append(str(error).splitlines()[0])
    assert not failures, "\n".join(failures)
