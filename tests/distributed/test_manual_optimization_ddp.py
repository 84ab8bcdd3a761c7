"""Lightning's manual optimization under data parallelism: the documented GAN (two optimizers toggled, the
discriminator's gradients clipped, schedulers stepped by hand) and gradient accumulation with a closure
(tests/scripts/manual_parity.py), on 2 gloo processes under DDP and FSDP, give one process's weights on the
same global batch; each rank's step losses average to its loss; a checkpoint of both optimizers and
schedulers resumes bit-exact, and in one process; without find_unused_parameters, DDP's wait is named; under
FSDP a root layer the step calls outside `self(x)` is named (its gradients would otherwise stay unsynced)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import SCRIPTS, run_ranks

SCRIPT = SCRIPTS / "manual_parity.py"


def run(out: Path, devices: int, forms: list[str], *args: str) -> dict[str, list[dict]]:
    """{form: [each rank's record]} of manual_parity.py on `devices` processes (a global batch of 8)."""
    batch = str(8 // devices)
    run_ranks(devices, SCRIPT, "trainer", str(out), ",".join(forms), "--batch", batch, *args, timeout=240)
    return {
        form: [json.loads((out / form / f"rank{r}.json").read_text()) for r in range(devices)]
        for form in forms
    }


def assert_matches_one_process(ranks: list[dict], one: dict, form: str) -> None:
    for rank, here in enumerate(ranks):
        for name, value in one["weights"].items():
            assert here["weights"][name] == pytest.approx(value, abs=1e-6), f"{form}: rank {rank}, {name}"
        assert here["attrs"] == one["attrs"], f"{form}: rank {rank}"
        assert [(s["opt"], s["step"], s["lr"]) for s in here["steps"]] == [
            (s["opt"], s["step"], s["lr"]) for s in one["steps"]
        ], f"{form}: rank {rank}"
    # each rank's loss is the mean over its half of the global batch: their mean is one process's
    for i, step in enumerate(one["steps"]):
        mean = sum(r["steps"][i]["loss"] for r in ranks) / len(ranks)
        assert mean == pytest.approx(step["loss"], abs=1e-6), f"{form}: step {i + 1} of {step['opt']}"
    assert ranks[0]["steps"] != ranks[1]["steps"]  # the ranks read different halves


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, forms",
    [("ddp", ["gan", "gan_tuple", "closure", "closure_layer"]), ("fsdp", ["gan", "closure"])],
)
def test_two_processes_match_one_process_on_the_same_global_batch(tmp_path, strategy, forms):
    one = run(tmp_path / "one", 1, forms)
    two = run(tmp_path / strategy, 2, forms, "--strategy", strategy)
    for form in forms:
        assert_matches_one_process(two[form], one[form][0], form)


@pytest.mark.slow
def test_a_ddp_checkpoint_of_both_optimizers_resumes_bit_exact_and_in_one_process(tmp_path):
    full = run(tmp_path / "full", 2, ["gan"])["gan"]
    part = run(tmp_path / "part", 2, ["gan"], "--max-steps", "6", "--save")["gan"]
    saved = str(tmp_path / "part" / "gan" / "saved")
    resumed = run(tmp_path / "resumed", 2, ["gan"], "--ckpt-path", saved)["gan"]
    for rank in range(2):
        assert part[rank]["steps"] + resumed[rank]["steps"] == full[rank]["steps"], f"rank {rank}"
        assert resumed[rank]["weights"] == full[rank]["weights"], f"rank {rank}"
    (alone,) = run(tmp_path / "alone", 1, ["gan"], "--ckpt-path", saved)["gan"]
    for name, value in full[0]["weights"].items():
        assert alone["weights"][name] == pytest.approx(value, abs=1e-6), name


@pytest.mark.slow
def test_a_toggled_gan_under_ddp_without_find_unused_parameters_is_told_to_set_it(tmp_path):
    done = run_ranks(
        2, SCRIPT, "trainer", str(tmp_path), "gan", "--batch", "4", "--strategy", "ddp_plain", check=False
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert (
        "reached only some parameters" in last and "allowed: DDPStrategy(find_unused_parameters=True)" in last
    )


@pytest.mark.slow
def test_under_fsdp_a_root_layer_run_outside_forward_is_named_not_left_unsynced(tmp_path):
    # the step runs outside FSDP's root forward (whose reduce-scatter would wait for a backward after it):
    # a root's layer the step calls directly meets its shards, and says what to do
    done = run_ranks(
        2,
        SCRIPT,
        "trainer",
        str(tmp_path),
        "closure_layer",
        "--batch",
        "4",
        "--strategy",
        "fsdp",
        check=False,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "ran a layer outside `self(x)`" in last and "declare it in transformer_blocks()" in last
