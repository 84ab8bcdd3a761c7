"""The tools' numeric flags (`trainer doctor`, `plan`, `replicas`, `lighthouse`): zero, negative, not finite or
absurd is refused in one line naming the flag and what is allowed, before anything starts. A value is never
swapped for a default behind the user's back (`--devices 0` used to run the doctor on 2 processes)."""

from __future__ import annotations

import os

import pytest
from helpers import SCRIPTS, TINY

from strategies.mesh import MeshStrategy
from trainer import cli
from trainer.fault_tolerance import launch

TOO_MANY = 4 * len(os.sched_getaffinity(0)) + 1  # one process more than this machine's bound


@pytest.fixture
def nothing_starts(monkeypatch):
    """No process starts: the doctor's spawn and the replicas' launcher fail the test if reached."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)

    def started(*args, **kwargs):
        raise AssertionError("processes were started for input that should have been refused")

    monkeypatch.setattr(MeshStrategy, "launch", started)
    monkeypatch.setattr(launch, "run_replica_groups", started)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["doctor", "--devices", "0"], "--devices 0 is invalid; allowed: 2 or more processes"),
        (["doctor", "--devices", "-4"], "--devices -4 is invalid; allowed: 2 or more processes"),
        (
            ["doctor", "--devices", str(TOO_MANY)],
            f"--devices {TOO_MANY} starts {TOO_MANY} processes on this machine; allowed: up to",
        ),
        (
            ["doctor", "--devices", "2", "--gpus-per-node", "0"],
            "--gpus-per-node 0 does not divide the world of 2",
        ),
        (
            ["doctor", "--devices", "2", "--iters", "1000000000"],
            "--iters 1000000000 is invalid; allowed: an int from 1 to",
        ),
        (["doctor", "--devices", "2", "--warmup", "-1"], "--warmup -1 is invalid; allowed: an int from 0 to"),
        (["doctor", "--devices", "2", "--sizes", "4K,100000G"], "message size 100000G needs"),
        (
            ["plan", str(TINY), "--gpus", "8", "--storage-gbps", "0"],
            "--storage-gbps 0.0; allowed: a finite number > 0",
        ),
        (
            ["plan", str(TINY), "--gpus", "8", "--storage-gbps", "inf"],
            "--storage-gbps inf; allowed: a finite number > 0",
        ),
        (
            ["plan", str(TINY), "--gpus", "8", "--mtbf-hours", "-5"],
            "--mtbf-hours -5.0; allowed: a finite number > 0",
        ),
        (
            ["plan", str(TINY), "--gpus", "8", "--gpu-memory", "nan"],
            "memory size 'nan' is invalid; allowed: a positive finite size",
        ),
        (
            ["replicas", "--groups", str(TOO_MANY), str(SCRIPTS / "ft_launch_script.py")],
            f"--groups {TOO_MANY} x --nproc-per-group 1 starts {TOO_MANY} processes",
        ),
    ],
)
def test_a_bad_number_is_one_line_before_anything_starts(argv, words, nothing_starts, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainer: error: ") and words in err and "\n" not in err, err


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["lighthouse", "--bind", "127.0.0.1:0", "--join-timeout-ms", str(10**23)],
            "argument --join-timeout-ms: '100000000000000000000000' is invalid; allowed: an int from 1 to",
        ),
        (["lighthouse", "--bind", "127.0.0.1:0", "--min-replicas", str(2**64)], "argument --min-replicas:"),
        (
            [
                "replicas",
                "--groups",
                "2",
                "--heartbeat-timeout-ms",
                "0",
                str(SCRIPTS / "ft_launch_script.py"),
            ],
            "argument --heartbeat-timeout-ms: '0' is invalid",
        ),
    ],
)
def test_a_lighthouse_option_out_of_range_is_argparses_one_line(
    argv, words, nothing_starts, monkeypatch, capsys
):
    def served(*args, **kwargs):
        raise AssertionError("a lighthouse was started for input that should have been refused")

    monkeypatch.setattr("trainer.fault_tolerance.lighthouse.start_lighthouse", served)
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert words in last and "allowed: an int from 1 to" in last, last
