"""`trainer replicas` as a user runs it: two replica groups of one process (torchrun with a restart each) of a
script with a ModelCheckpoint. One launch goes through a hang (SIGSTOP, then SIGCONT), a kill that torchrun
restarts, and the whole job killed at a checkpoint; a relaunch then resumes from the checkpoints. Fast: the
launcher's one-line errors, its summary line, `FaultTolerance.from_env`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import SCRIPTS, WIDE, Process, launch_env, rank_slots, start_process

pytest.importorskip("torchft")

SCRIPT = SCRIPTS / "ft_launch_script.py"
ENV = launch_env()
DEADLINE_S = 120  # each wait; the whole test takes ~40 s on a loaded 2-core machine


def start(root: Path, name: str, min_replicas: int, *script_args: str) -> Process:
    """`trainer replicas` of 2 groups (a dead group is noticed after 1 s without a heartbeat, a collective
    with a silent peer fails after the script's 4 s timeout_s); its output in ROOT/NAME.out and .err."""
    cmd = [
        sys.executable, "-m", "trainer.cli", "replicas", "--groups", "2", "--max-restarts", "1",
        "--min-replicas", str(min_replicas), "--heartbeat-timeout-ms", "1000", "--bind", "127.0.0.1",
        str(SCRIPT), "--root", str(root), *script_args,
    ]  # fmt: skip
    out, err = open(root / f"{name}.out", "w"), open(root / f"{name}.err", "w")
    return start_process(cmd, stdout=out, stderr=err, env=ENV)


def rows(root: Path, replica: int) -> list[dict]:
    log = root / f"replica{replica}" / "steps.jsonl"
    text = log.read_text() if log.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def wait_until(what: str, ready: Callable[[], object], job: Process, root: Path) -> object:
    """Poll `ready` until it returns something truthy; fail naming `what` (with the job's stderr) when the
    job ends first or DEADLINE_S passes."""
    deadline = time.monotonic() + DEADLINE_S
    while not (found := ready()):
        if job.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen (job status {job.poll()})\n" + _tail(root))
        time.sleep(0.02)
    return found


def _tail(root: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(root.glob("*.err")))


@contextlib.contextmanager
def nothing_left(root: Path, jobs: list[Process]) -> Iterator[None]:
    """However the block ends: every launcher stopped (SIGTERM: it stops its groups), every group process
    the step logs name killed."""
    try:
        yield
    finally:
        for job in jobs:
            if job.poll() is None:
                job.terminate()
                try:
                    job.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    job.kill()
                    job.wait()
        for pid in {row["pid"] for replica in (0, 1) for row in rows(root, replica)}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def agree(a: list[dict], b: list[dict]) -> None:
    """Every step both groups logged: the same decision and bit-identical parameters."""
    by_step = {row["step"]: row for row in a}
    shared = [(by_step[row["step"]], row) for row in b if row["step"] in by_step]
    assert shared, "the groups logged no step in common"
    for x, y in shared:
        assert (x["committed"], x["params"]) == (y["committed"], y["params"]), (x, y)


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--groups", "0"], "replicas --groups 0; allowed: an int >= 1"),
        (
            ["--groups", "2", "--min-replicas", "3"],
            "replicas --min-replicas 3 exceeds --groups 2; allowed: 1 to 2",
        ),
        (["--groups", "2", "--nproc-per-group", "0"], "replicas --nproc-per-group 0; allowed: an int >= 1"),
        (["--groups", "2", "--max-restarts", "-1"], "replicas --max-restarts -1; allowed: an int >= 0"),
        (
            ["--groups", "2", "--bind", "127.0.0.1:29510"],
            "replicas --bind '127.0.0.1:29510'; allowed: a host name",
        ),
    ],
)
def test_replicas_refuses_bad_input_in_one_line(argv, error, capsys):
    from trainer.cli import main

    assert main(["replicas", *argv, str(SCRIPT)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trainer: error: {error}") and err.count("\n") == 1, err


def test_replicas_refuses_a_target_it_cannot_run(tmp_path, capsys):
    from trainer.cli import main

    assert main(["replicas", "--groups", "2", str(tmp_path / "train.py")]) == 2
    assert f"replicas script '{tmp_path / 'train.py'}' does not exist" in capsys.readouterr().err
    assert main(["replicas", "--groups", "2", "notes.txt"]) == 2
    assert "allowed: a recipe (.yaml) or a Python script (.py)" in capsys.readouterr().err


def test_a_recipe_runs_in_each_group_as_that_group_with_a_run_folder_of_its_own(tmp_path):
    from helpers import SMALL, TINY

    from trainer.commands.replicas import group_entry
    from trainer.config import load_recipe
    from trainer.fault_tolerance.launch import Launch

    launch = Launch(groups=3, min_replicas=2, bind="10.0.0.7")
    argv = group_entry(TINY, [*SMALL, f"trainer.default_root_dir={tmp_path}"], launch)(2, "10.0.0.1:29510")
    assert argv[:4] == ["-m", "trainer.cli", "fit", str(TINY)]
    assert argv[argv.index("--ckpt-path") + 1] == "last"  # a restarted group resumes in its own folder
    recipe = [item for item in argv[4:] if "=" in item]
    config = load_recipe(TINY, recipe)  # what `trainer fit` in group 2 resolves
    assert config["fault_tolerance"] == {"lighthouse": "10.0.0.1:29510", "replica_id": 2, "replicas": 3,
                                         "min_replicas": 2, "timeout_s": 60.0, "quorum_timeout_s": 60.0,
                                         "bind": "10.0.0.7", "sync_every": 1, "outer_lr": 0.7,
                                         "outer_momentum": 0.9, "sync_optimizer_state": False,
                                         "sync_warmup_steps": 0, "sync_combined_second_moment": False, "quorum_every": 1,
                                         "max_quorum_interval_s": 10.0}  # fmt: skip
    assert Path(config["trainer"]["default_root_dir"]) == tmp_path / "replica_2"
    given = group_entry(TINY, [*SMALL, "--ckpt-path", "none"], launch)(0, "10.0.0.1:29510")
    assert given.count("--ckpt-path") == 1 and given[given.index("--ckpt-path") + 1] == "none"


def test_the_summary_names_the_groups_that_failed_for_good():
    from trainer.fault_tolerance.launch import Launch, _summary

    launch = Launch(groups=3, max_restarts=2)
    assert _summary(launch, [0, 0, 0], []) == ("3 replica group(s) finished", 0)
    line, status = _summary(launch, [0, 1, 0], [])
    assert status == 1 and line.startswith(
        "replica group 1 (torchrun exit 1) failed for good after up to --max-restarts=2 restart(s); 2 of 3 finished"
    ), line
    line, status = _summary(launch, [-15, 0, 1], [signal.SIGTERM])
    assert status == 128 + signal.SIGTERM and line.startswith("stopped by SIGTERM"), line


def test_fault_tolerance_from_the_launchers_environment(monkeypatch):
    from trainer.fault_tolerance import FaultTolerance
    from trainer.fault_tolerance.launch import Launch

    launch = Launch(groups=4, min_replicas=2)
    for key, value in launch.group_env("10.0.0.1:29510", 3).items():
        monkeypatch.setenv(key, value)
    ft = FaultTolerance.from_env(timeout_s=5)
    assert ft == FaultTolerance(
        "10.0.0.1:29510", 3, replicas=4, min_replicas=2, timeout_s=5, bind="127.0.0.1"
    )
    assert FaultTolerance.from_env(replica_id=0).replica_id == 0  # a field given wins over the environment
    monkeypatch.setenv("REPLICA_GROUP_ID", "three")
    with pytest.raises(
        ValueError, match=r"^FaultTolerance.from_env: REPLICA_GROUP_ID='three'; allowed: an int"
    ):
        FaultTolerance.from_env()
    for key in ("TORCHFT_LIGHTHOUSE", "NUM_REPLICA_GROUPS"):
        monkeypatch.delenv(key)
    with pytest.raises(
        ValueError, match=r"^FaultTolerance.from_env: TORCHFT_LIGHTHOUSE, NUM_REPLICA_GROUPS not set"
    ):
        FaultTolerance.from_env(replica_id=0)


@pytest.mark.slow
def test_replicas_launcher_survives_a_hang_a_restart_and_the_whole_job_killed(tmp_path):
    jobs: list[Process] = []
    with rank_slots(WIDE), nothing_left(tmp_path, jobs):
        jobs.append(job := start(tmp_path, "first", 1))
        wait_until("a step of both groups together", lambda: any(r["replicas"] == 2 for r in rows(tmp_path, 1)),
                   job, tmp_path)  # fmt: skip

        # (a) a hang: group 1's process stops mid-run; the survivor gives up on it after the heartbeat
        # timeout (and timeout_s for a collective it was in) and commits steps alone
        hung = rows(tmp_path, 1)[-1]
        os.kill(hung["pid"], signal.SIGSTOP)
        solo = wait_until(
            "the survivor committing alone while group 1 hangs",
            lambda: next((r for r in rows(tmp_path, 0) if r["step"] > hung["step"] + 1
                          and r["committed"] and r["replicas"] == 1), None),
            job, tmp_path,
        )  # fmt: skip
        # SIGCONT: the same process carries on; it is behind, so it rejoins with the survivor's live state
        os.kill(hung["pid"], signal.SIGCONT)
        back = wait_until(
            "group 1 rejoining after SIGCONT",
            lambda: next((r for r in rows(tmp_path, 1) if r["step"] > solo["step"] and r["replicas"] == 2), None),
            job, tmp_path,
        )  # fmt: skip
        assert (back["pid"], back["attempt"]) == (hung["pid"], 0), "SIGCONT: the hung process itself rejoins"

        # (c) a kill: torchrun restarts group 1 (its one restart), which rejoins the running job live
        os.kill(back["pid"], signal.SIGKILL)
        restarted = wait_until(
            "group 1 restarted by torchrun and rejoined",
            lambda: next((r for r in rows(tmp_path, 1) if r["attempt"] == 1 and r["replicas"] == 2), None),
            job, tmp_path,
        )  # fmt: skip
        assert restarted["first"] > back["step"], "the restarted group continued at the current step"

        # (b) the whole job killed: both groups hold at a checkpoint two intervals ahead (the script's
        # ModelCheckpoint saves every 10 steps), then SIGTERM to the launcher goes to every group
        target = (max(r["step"] for r in rows(tmp_path, 0)) // 10 + 2) * 10
        (tmp_path / "hold.tmp").write_text(str(target))
        (tmp_path / "hold.tmp").rename(tmp_path / "hold")  # whole, when a group reads it
        held = [tmp_path / f"replica{replica}" / "held" for replica in (0, 1)]
        wait_until("both groups at a checkpoint", lambda: all(p.exists() for p in held), job, tmp_path)
        step = target
        assert [int(p.read_text()) for p in held] == [step, step]
        before = [rows(tmp_path, replica) for replica in (0, 1)]
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=DEADLINE_S)
        err = (tmp_path / "first.err").read_text()
        assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert err.splitlines()[-1].startswith(
            "replicas: stopped by SIGTERM, forwarded to every replica group"
        ), err
        assert "[replica 0] " in err and "[replica 1] " in err, "each group's output is prefixed"
        assert not any(alive(row["pid"]) for log in before for row in log), "a group process outlived the job"
        for replica in (0, 1):
            saved = [p.name for p in (tmp_path / f"replica{replica}" / "checkpoints").glob("step-*")]
            assert f"step-{step:08d}" in saved, (replica, saved)  # each group's own run folder
        # what every group saw: one decision and the same parameters per step, through the hang and the kill
        agree(*before)

        # the recovery path when every group died: a relaunch resumes each group from its checkpoint. With
        # --min-replicas 2 no group trains alone before the other is up (with 1, the first one up would take
        # steps from its checkpoint alone, and a group that comes up after it ended would train alone too)
        # Group 0 resumes from its checkpoint before the newest (as if its newest save were lost): the newest
        # state wins whoever torchft ranks first, so group 0 heals to group 1's step
        (tmp_path / "hold").unlink()
        jobs.append(job := start(tmp_path, "relaunch", 2, "--steps", "4", "--older", "0"))
        assert job.wait(timeout=DEADLINE_S) == 0, _tail(tmp_path)
        out = (tmp_path / "relaunch.out").read_text()
        assert out.splitlines()[-1] == "replicas: 2 replica group(s) finished", out
    after = [rows(tmp_path, replica)[len(before[replica]) :] for replica in (0, 1)]
    assert [log[0]["first"] for log in after] == [step, step], (
        "the relaunch did not go on from the newest checkpoint"
    )
    agree(*after)
    assert all(r["replicas"] == 2 for log in after for r in log), (
        "the relaunched groups did not train together"
    )
