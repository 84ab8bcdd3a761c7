"""GradientNoiseScale under 2-process gloo DDP against the closed form (tests/noise_scale_problem.py): each
rank's gradient read by the comm hook before the all-reduce (B_small = the rank's batch) against the
all-reduced one (B_big = the global batch); with DDP's own all-reduce and wrapped around fp16 compression
with accumulation, whose hook it must keep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import SEED, call_ranks, join_world, quiet
from noise_scale_problem import (
    DIM,
    NOISE_STD,
    OFFSET,
    LinearRegression,
    closed_form_noise_scale,
    measured_noise_scale,
    regression_problem,
)
from torch.utils.data import DataLoader

from callbacks import Callback
from strategies import DDPStrategy, FSDPStrategy
from trainer import Trainer

pytestmark = pytest.mark.slow

WORLD, STEPS = 2, 150
# name -> (DDPStrategy kwargs, accumulate_grad_batches, micro-batch): 64 samples per rank and step in both
RUNS = {"allreduce": ({}, 1, 64), "fp16-accumulated": ({"gradient_compression": "fp16"}, 2, 32)}


class CommHooks(Callback):
    """The names of the comm hooks DDP holds when the fit starts."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def on_fit_start(self, trainer, module):
        self.names = [hook.__name__ for hook, _ in trainer.strategy.model._comm_hooks]


def _rank(rank: int, port: int, root: str) -> None:
    """One rank: the runs of RUNS one after another in the same world; rank 0 writes what they logged."""
    join_world(rank, WORLD, port)
    got = {}
    for name, (kwargs, accumulate, micro_batch) in RUNS.items():
        hooks = CommHooks()
        got[name] = measured_noise_scale(
            Path(root) / name,
            STEPS,
            accumulate,
            micro_batch,
            callbacks=(hooks,),
            strategy=DDPStrategy(**kwargs),
        )
        got[name]["hooks"] = hooks.names
    # without the callback DDP keeps its built-in all-reduce: no Python hook, no norm
    data, weights = regression_problem(SEED)
    plain = CommHooks()
    trainer = Trainer(
        max_steps=1,
        strategy=DDPStrategy(),
        callbacks=[plain],
        default_root_dir=Path(root) / "plain",
        **quiet(enable_checkpointing=False),
    )
    trainer.fit(LinearRegression(weights), DataLoader(data, batch_size=8))
    got["plain"] = plain.names
    try:  # FSDP holds no rank's whole gradient: refused in one line on every rank
        measured_noise_scale(Path(root) / "fsdp", 1, 1, 8, strategy=FSDPStrategy())
    except ValueError as err:
        got["fsdp"] = str(err)
    if rank == 0:
        (Path(root) / "got.json").write_text(json.dumps(got))


def test_noise_scale_under_ddp_is_within_20_percent_of_the_closed_form(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # bound on a port it picks
    call_ranks(_rank, WORLD, store.port, str(tmp_path))
    got = json.loads((tmp_path / "got.json").read_text())
    expected = closed_form_noise_scale(DIM, NOISE_STD, OFFSET)
    for name in RUNS:
        run = got[name]
        assert (run["noise_scale/batch_small"], run["noise_scale/batch_big"]) == (64, 128), name
        error = run["noise_scale"] / expected - 1
        assert abs(error) < 0.2, f"{name}, seed {SEED}: B_simple {run['noise_scale']:.1f} vs {expected:.1f}"
    # the callback's norm runs inside the hook DDP allows: around its all-reduce, or around the compression's
    assert [got[name]["hooks"] for name in RUNS] == [["allreduce_hook"], ["fp16_compress_hook"]]
    assert got["plain"] == []
    assert got["fsdp"].startswith("FSDPStrategy reduce-scatters each block's gradient in the backward")
    assert "\n" not in got["fsdp"]
