"""Fault tolerance across real processes: the fault drill (two SIGKILLs under torchrun), SIGTERM,
stragglers, the NaN guard on one rank, and checkpoint validation of sharded (FSDP) checkpoints."""

from __future__ import annotations

import json
import random
import signal
import time

import pytest
from helpers import (
    FAILURE_SCRIPT,
    FSDP_SCRIPT,
    SEED,
    TIMING_SCRIPT,
    assert_params_close,
    failure,
    read_metrics,
    run_script,
    start_ranks,
)
from helpers import script_result as result

pytestmark = pytest.mark.slow


def test_fault_drill_two_sigkills_under_torchrun_end_exactly_like_an_uninterrupted_run(tmp_path):
    rng = random.Random(SEED)  # TRAINER_TEST_SEED=N explores other kill steps; a failure prints its seed
    first = rng.randint(3, 7)
    second = rng.randint(first + 2, 11)
    bad_rank = rng.randint(0, 1)
    print(f"fault drill: rank {bad_rank} is killed before step {first}, then before step {second}")
    common = ["--steps", "12", "--ckpt-every", "2", "--shuffle", "--global-batch", "64"]
    run_script(2, FAILURE_SCRIPT, tmp_path, "straight", *common)
    drill = [
        "--devices",
        "2",
        *common,
        "--resume",
        "--bad-rank",
        str(bad_rank),
        "--kill-steps",
        f"{first},{second}",
    ]
    done, root = run_script(
        2, FAILURE_SCRIPT, tmp_path, "drill", *drill, torchrun=True, max_restarts=2, timeout=300
    )
    assert done.stderr.count("resuming from") == 2, failure(done.stderr)
    assert_params_close(result(tmp_path, "drill")["params"], result(tmp_path, "straight")["params"], atol=0)
    assert read_metrics(root) == read_metrics(tmp_path / "straight")
    report = [line for line in done.stderr.splitlines() if "effective training time" in line]
    assert report and "2 restart(s)" in report[-1], failure(done.stderr)
    kept = sorted(p.name for p in (root / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept and all((root / "checkpoints" / name / "validated.json").exists() for name in kept)


def wait_for_step(root, step, proc, timeout=120):
    """Until the run's JSONL log shows `step` (the process is training and has a checkpoint behind it)."""
    log = root / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        if log.exists() and any(
            json.loads(line).get("step", 0) >= step for line in log.read_text().splitlines()
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run never reached step {step}")


def terminate_mid_run(root, out, torchrun: bool = False):
    """Start a long 2-rank job of sleepy steps with a Timer, SIGTERM the launched process (rank 0, or
    torchrun's agent) once step 3 is logged, and return its exit code and stderr."""
    args = ["--steps", "1000", "--ckpt-every", "1000", "--timer", "--step-sleep", "0.02", "--shuffle"]
    # SIGTERM to torchrun as a user sends it: fresh interpreters (to rank 0: forks, as other launches)
    proc = start_ranks(
        2, TIMING_SCRIPT, *args, "--root", str(root), "--out", str(out), torchrun=torchrun, fresh=torchrun
    )
    wait_for_step(root, 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)  # the grace period
    return proc.returncode, stderr


def test_sigterm_checkpoints_and_exits_0_and_the_run_resumes_exactly(tmp_path):
    root = tmp_path / "stopped"
    # to rank 0 only: rank 1 learns it through the per-step all-reduce
    code, stderr = terminate_mid_run(root, tmp_path / "stopped.json")
    assert code == 0, failure(stderr)
    stopped = json.loads((tmp_path / "stopped.json").read_text())["global_step"]
    assert 3 <= stopped < 1000 and f"stopping at step {stopped} (received SIGTERM)" in stderr
    assert (root / "checkpoints" / f"step-{stopped:08d}" / "validated.json").exists()
    steps = ["--steps", str(stopped + 3), "--shuffle"]
    run_script(2, TIMING_SCRIPT, tmp_path, "stopped", *steps, "--resume")  # the same root: continue it
    run_script(2, TIMING_SCRIPT, tmp_path, "straight", *steps)
    assert_params_close(result(tmp_path, "stopped")["params"], result(tmp_path, "straight")["params"], atol=0)


def test_sigterm_to_torchrun_reaches_the_workers_and_they_checkpoint(tmp_path):
    root = tmp_path / "stopped"
    code, stderr = terminate_mid_run(root, tmp_path / "stopped.json", torchrun=True)
    # torchrun forwards SIGTERM to its workers, waits for them, then exits 1 itself (its SignalException)
    assert code == 1 and "Received 15 death signal, shutting down workers" in stderr, failure(stderr)
    stopped = json.loads((tmp_path / "stopped.json").read_text())["global_step"]
    assert f"stopping at step {stopped} (received SIGTERM)" in stderr
    assert (root / "checkpoints" / f"step-{stopped:08d}" / "validated.json").exists()


def test_a_slow_rank_is_named_and_an_even_job_has_no_straggler(tmp_path):
    # the phase times are a fake clock's, moved only by the steps' sleeps: 0.01 s a step, rank 1 0.1 s more
    args = ["--steps", "8", "--straggler-every", "4", "--step-sleep", "0.01", "--fake-clock"]
    done, _ = run_script(2, TIMING_SCRIPT, tmp_path, "slow", *args, "--slow-rank", "1", "--slow-sleep", "0.1")
    for steps in ("1-4", "5-8"):  # 4 x 0.11 s against the median of 4 x 0.01 s and 4 x 0.11 s
        assert (
            "straggler: rank 1 (0.440 s, 1.8x) vs the median 0.240 s of data/forward/optimizer time over "
            f"steps {steps}; the slowest rank sets every rank's step time"
        ) in done.stderr, failure(done.stderr)
    assert result(tmp_path, "slow")["stragglers"] == [{"step": 4, "ranks": [1]}, {"step": 8, "ranks": [1]}]
    done, _ = run_script(2, TIMING_SCRIPT, tmp_path, "even", *args)
    assert "straggler:" not in done.stderr and result(tmp_path, "even")["stragglers"] == []


def test_a_nan_on_one_rank_is_skipped_on_every_rank(tmp_path):
    done, root = run_script(
        2, FAILURE_SCRIPT, tmp_path, "nan", "--steps", "6", "--bad-rank", "1", "--nan-step", "3"
    )
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["skipped"] for r in ranks] == [1, 1]
    assert ranks[0]["params"] == ranks[1]["params"]  # the replicas stayed identical
    assert "NaNGuard: step 3: gradient norm is not finite on 1 rank(s)" in done.stderr


@pytest.mark.parametrize("stage", [2, 3])
def test_a_sharded_checkpoint_with_wrong_weights_fails_validation(tmp_path, stage):
    args = ["--stage", str(stage), "--steps", "6", "--ckpt-every", "2"]
    # a validation loader: only a reloaded model's validation loss can tell the wrong weights apart
    done, root = run_script(2, FSDP_SCRIPT, tmp_path, "bad", *args, "--validate", "--bad-save-step", "4")
    assert "checkpoint step-00000004 failed validation (rank 0: live" in done.stderr
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == [
        "bad-step-00000004",
        "step-00000002",
        "step-00000006",
    ]
