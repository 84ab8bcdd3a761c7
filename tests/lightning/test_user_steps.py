"""User steps run unchanged under every wrapper: `self(x)`, `self.forward(x)` and `self.net(x)` inside
`training_step` and `validation_step` train and validate exactly as in one process, under DDP and each
ZeRO stage (2 real gloo processes), and through activation-checkpointed blocks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, regression_loader, run_ranks
from user_steps import FIT, GLOBAL_BATCH, MODULES, STEPS

from trainer import Trainer

SCRIPT = SCRIPTS / "steps_script.py"


def one_process(cls) -> dict:
    """The reference: one process, the whole global batch per step, same seed and clipping."""
    torch.manual_seed(0)
    module = cls()
    trainer = Trainer(
        **FIT,
        default_root_dir=Path(os.environ["PYTEST_TMP"]),
    )
    trainer.fit(module, regression_loader(batch_size=GLOBAL_BATCH), regression_loader(batch_size=8, n=64))
    torch.manual_seed(0)
    validated = Trainer(enable_progress_bar=False, default_root_dir=os.environ["PYTEST_TMP"]).validate(
        cls(), regression_loader(batch_size=8, n=64)
    )
    return {
        "params": [p.detach().flatten().tolist() for p in module.parameters()],
        "fit_metrics": dict(trainer.callback_metrics),
        "validate": validated,
        "training_steps": module.training_steps,
    }


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    os.environ["PYTEST_TMP"] = str(tmp_path_factory.mktemp("single"))
    return {call: one_process(cls) for call, cls in MODULES.items()}


def test_steps_calling_self_forward_or_a_submodule_train_in_one_process(references):
    for call, ref in references.items():
        assert ref["training_steps"] == STEPS, call
        assert ref["fit_metrics"]["val_mse"] < ref["validate"]["val_mse"], f"{call}: training did not help"


LAYOUTS = ["ddp", "fsdp1", "fsdp2", "fsdp3", "fsdp3:full"]


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory) -> dict:
    """Every layout's results (steps_script.py), trained one after another in one launch of 2 processes."""
    tmp = tmp_path_factory.mktemp("wrapped")
    out = tmp / "out.json"
    run_ranks(2, SCRIPT, "--layouts", ",".join(LAYOUTS), "--root", str(tmp), "--out", str(out), timeout=400)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_user_steps_under_every_wrapper_match_one_process(wrapped, references, layout):
    got = wrapped[layout]
    for call, ref in references.items():
        run = got[call]
        assert run["training_steps"] == STEPS, (
            f"{call}: rank 0 ran training_step {run['training_steps']} times"
        )
        for i, (g, e) in enumerate(zip(run["params"], ref["params"], strict=True)):
            diff = (torch.tensor(g) - torch.tensor(e)).abs().max().item()
            assert diff <= 1e-5, f"{layout} {call}: parameter {i} differs from one process by {diff:.2e}"
        for key in ("val_mse", "train_mse"):
            a, b = run["fit_metrics"][key], ref["fit_metrics"][key]
            assert abs(a - b) <= 1e-5, f"{layout} {call}: fit {key} {a} vs one process {b}"
        a, b = run["validate"]["val_mse"], ref["validate"]["val_mse"]
        assert abs(a - b) <= 1e-5, f"{layout} {call}: validate val_mse {a} vs one process {b}"
