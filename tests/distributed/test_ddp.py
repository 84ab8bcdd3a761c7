"""DDP in real multi-process gloo groups: equivalence with one process, launching, failures, restarts."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import (
    DDP_SCRIPT,
    FAILURE_SCRIPT,
    Regression,
    assert_params_close,
    failure,
    launch_env,
    rank_command,
    read_metrics,
    regression_loader,
    run_script,
    run_world,
    start_process,
)
from helpers import script_result as result

from trainer import Trainer

pytestmark = pytest.mark.slow


def last_line(done: subprocess.CompletedProcess) -> str:
    """The last non-empty line the user sees: stderr comes after stdout."""
    return [line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-1]


def single_process(tmp: Path, module=None, loader=None, steps: int = 8):
    """The reference: one process, the whole global batch (16) per step, same seed and clipping."""
    torch.manual_seed(0)
    module = module or Regression()
    Trainer(
        max_steps=steps,
        gradient_clip_val=0.5,
        seed=0,
        log_every_n_steps=1,
        enable_progress_bar=False,
        default_root_dir=tmp / "single",
    ).fit(module, loader or regression_loader(batch_size=16))
    return [p.detach().flatten().tolist() for p in module.parameters()], read_metrics(tmp / "single")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    """The folder holding the default self-spawned 2-rank run "spawned", which three tests inspect or compare
    other launchers with: launched once for all of them, as a user launches it (a fresh interpreter)."""
    tmp = tmp_path_factory.mktemp("ddp")
    run_script(2, DDP_SCRIPT, tmp, "spawned", fresh=True)
    return tmp


# the 2-rank runs of the tests below, trained one after another in one torchrun world launched once
TWO_RANK_RUNS = {
    **{f"accumulate-{k}": ["--accumulate", str(k)] for k in (1, 2)},
    "counted": ["--accumulate", "4", "--steps", "4", "--count-allreduces"],
    **{f"compressed-{c}": ["--compression", c, "--steps", "12"] for c in ("fp16", "powersgd")},
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """The folder holding every run of TWO_RANK_RUNS (each under its name, as `run_script` leaves it)."""
    tmp = tmp_path_factory.mktemp("ddp-2-ranks")
    run_world(2, DDP_SCRIPT, tmp, TWO_RANK_RUNS)
    return tmp


@pytest.mark.parametrize("devices, accumulate", [(2, 1), (2, 2), (4, 2)])
def test_ddp_matches_one_process_with_the_same_global_batch(tmp_path, two_ranks, devices, accumulate):
    if devices == 2:
        tmp, name = two_ranks, f"accumulate-{accumulate}"
    else:
        tmp, name = tmp_path, "ddp"
        run_script(devices, DDP_SCRIPT, tmp, name, "--accumulate", str(accumulate))
    params, losses = single_process(tmp_path)
    assert result(tmp, name)["world_size"] == devices
    ddp_losses = read_metrics(tmp / name)
    for step, loss in losses.items():
        assert abs(ddp_losses[step] - loss) <= 1e-5, f"step {step}: ddp {ddp_losses[step]} vs single {loss}"
    assert_params_close(result(tmp, name)["params"], params)


def test_accumulated_micro_batches_are_all_reduced_once_per_step(two_ranks):
    """The tiny model's gradients fit one DDP bucket: one all-reduce per optimizer step, not one per
    micro-batch (DDP's no_sync on all but the last)."""
    assert result(two_ranks, "counted")["allreduces"] == [1, 1, 1, 1]


def test_self_spawn_then_torchrun_spawns_nothing_more(tmp_path, spawned):
    ranks = [json.loads((spawned / "spawned" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[1]["ppid"] == ranks[0]["pid"], "rank 0 is the user's process and the parent of rank 1"

    _, root = run_script(2, DDP_SCRIPT, tmp_path, "torchrun", "--devices", "2", torchrun=True, fresh=True)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["ppid"] == ranks[1]["ppid"], "both ranks are children of torchrun's agent"
    assert not (root / "rank2.json").exists()
    assert_params_close(result(tmp_path, "torchrun")["params"], result(spawned, "spawned")["params"], atol=0)


def test_two_torchrun_nodes_on_one_machine_train_together(tmp_path, spawned):
    # the test hosts the rendezvous store on a port the system picks; both nodes' agents are its clients
    # (the agents and their workers are forks: test_self_spawn_then_torchrun_... starts torchrun fresh)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{store.port}"
    nodes = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node_rank={node}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}",
            "--rdzv_id=two-nodes",
            "--rdzv_conf=is_host=false",
            str(DDP_SCRIPT),
            "--devices",
            "1",
            "--num-nodes",
            "2",
            "--root",
            str(tmp_path / "nodes"),
            "--out",
            str(tmp_path / "nodes.json"),
        ]
        nodes.append(start_process(cmd, env=launch_env(), stderr=subprocess.PIPE, text=True))
    for proc in nodes:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
    assert result(tmp_path, "nodes")["world_size"] == 2  # the same run as the 2 processes of one node
    assert_params_close(result(tmp_path, "nodes")["params"], result(spawned, "spawned")["params"], atol=0)


@pytest.mark.parametrize(
    "bad_rank, last",
    [
        (0, "[rank0]: RuntimeError: deliberate failure on rank 0 at step 3"),
        (1, "rank 1 failed: RuntimeError: deliberate failure on rank 1 at step 3"),
    ],
    ids=["rank0", "rank1"],
)
def test_a_rank_that_raises_ends_the_job_promptly_with_its_error_as_the_last_line(tmp_path, bad_rank, last):
    # promptly: the job ends long before the collective timeout (600 s) a waiting rank would hit; the
    # subprocess timeout fails the test otherwise
    args = ["--bad-rank", str(bad_rank), "--bad-step", "3", "--raise-error"]
    done, _ = run_script(2, FAILURE_SCRIPT, tmp_path, "raise", *args, check=False)
    assert done.returncode != 0
    assert last_line(done).endswith(last), failure(done.stderr)  # not the other rank's broken connection
    assert "Traceback" in done.stderr.split(f"deliberate failure on rank {bad_rank}")[0]  # its traceback too
    assert "timed out" not in done.stderr, failure(done.stderr)  # nothing waited for a timeout


def test_the_same_error_on_every_rank_prints_one_traceback(tmp_path):
    args = ["--every-rank", "--bad-step", "3", "--raise-error"]
    done, _ = run_script(2, FAILURE_SCRIPT, tmp_path, "raise", *args, check=False)
    assert done.returncode != 0
    assert done.stderr.count("Traceback (most recent call last)") == 1, failure(done.stderr)
    error = "RuntimeError: deliberate failure on rank every at step 3"
    # the traceback's last line, or one line that names the rank which printed it
    assert last_line(done).endswith(error), failure(done.stderr)


def test_a_killed_worker_ends_the_job(tmp_path):
    args = ["--bad-rank", "1", "--bad-step", "3", "--sigkill"]
    done, _ = run_script(2, FAILURE_SCRIPT, tmp_path, "killed", *args, check=False)
    assert done.returncode != 0
    assert last_line(done).endswith("rank 1 was killed by signal 9"), failure(done.stderr)


def test_a_collective_timeout_names_the_rank_that_stopped_answering(tmp_path):
    # rank 1 takes longer to start than the timeout: starting is no collective, and must not time out
    args = ["--bad-rank", "1", "--bad-step", "2", "--hang", "--timeout", "4"]
    done, root = run_script(2, FAILURE_SCRIPT, tmp_path, "hang", *args, "--start-delay", "5", check=False)
    assert done.returncode != 0
    assert "rank 0: a collective timed out after 4s; rank(s) [1] stopped answering" in last_line(done)
    assert list(read_metrics(root)) == [1, 2], failure(done.stderr)  # the hang, not the start, timed out


def test_waits_on_a_slow_checkpoint_write_are_sized_to_its_bytes_not_to_the_collective_timeout(tmp_path):
    # rank 1's disk takes 9 s for its first file (a sleep lasts at least that long), so rank 0 waits longer
    # than the 6 s collective timeout. At an assumed floor of 30 B/s the ~4 kB state allows 6 s + ~130 s for
    # the waits on its I/O: no load on this machine makes 9 s reach that; a fixed 6 s wait would always fail
    common = ["--steps", "2", "--ckpt-every", "2", "--timeout", "6", "--slow-disk", "9"]
    _, root = run_script(2, FAILURE_SCRIPT, tmp_path, "slow-disk", *common, "--io-floor", "30", timeout=180)
    assert (root / "checkpoints" / "step-00000002" / "validated.json").exists()


def test_torchrun_restart_after_sigkill_resumes_from_the_checkpoint(tmp_path):
    common = ["--steps", "10", "--ckpt-every", "2", "--shuffle", "--global-batch", "64"]
    run_script(2, FAILURE_SCRIPT, tmp_path, "straight", *common)
    killed = ["--devices", "2", *common, "--resume", "--bad-rank", "1", "--bad-step", "7", "--sigkill"]
    # torchrun's restart as a user runs it: fresh interpreters (the fault drill's restarts are forks)
    launch = {"torchrun": True, "max_restarts": 1, "fresh": True}
    done, root = run_script(2, FAILURE_SCRIPT, tmp_path, "restarted", *killed, timeout=240, **launch)
    assert "resuming from" in done.stderr and "step-00000006" in done.stderr  # mid-epoch: 4 steps per epoch
    assert_params_close(
        result(tmp_path, "restarted")["params"], result(tmp_path, "straight")["params"], atol=0
    )
    assert read_metrics(root) == read_metrics(tmp_path / "straight")


def free_port() -> int:
    """A port the system reports free now (another process may take it before it is bound)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slurm_job(root: Path, out: Path) -> list[str]:
    """Run two SLURM tasks of one job on this machine; the stderr of each task that failed."""
    env = launch_env(
        SLURM_NTASKS="2",
        SLURM_NODELIST="localhost",
        SLURM_JOB_ID="4242",
        MASTER_PORT=str(free_port()),  # as a job script exports it: every task must know it before starting
        SLURM_JOB_NAME="train",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NODEID="0",
    )
    tasks = [
        subprocess.Popen(
            rank_command(2, DDP_SCRIPT, "--root", str(root), "--out", str(out)),
            env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    _, first = tasks[0].communicate(timeout=120)
    if tasks[0].returncode:  # as srun does: a failed task ends the job step
        tasks[1].kill()
        tasks[1].communicate()
        return [first]
    _, second = tasks[1].communicate(timeout=120)
    return [second] if tasks[1].returncode else []


def test_slurm_tasks_join_one_world(tmp_path, spawned):
    out, root = tmp_path / "slurm.json", tmp_path / "slurm"
    # SLURM tasks agree on a port before any of them runs, so another process may take it before rank 0
    # binds it: another free port then
    for attempt in range(3):
        failures = slurm_job(root / str(attempt), out)
        if not any("EADDRINUSE" in err for err in failures):
            break
    assert not failures, failures[0][-3000:]
    assert_params_close(json.loads(out.read_text())["params"], result(spawned, "spawned")["params"], atol=0)


@pytest.mark.parametrize("compression", ["fp16", "powersgd"])
def test_gradient_compression_trains_close_to_exact_all_reduce(tmp_path, two_ranks, compression):
    params, _ = single_process(tmp_path, steps=12)
    got = result(two_ranks, f"compressed-{compression}")["params"]
    assert_params_close(got, params, atol=5e-2)
    assert (
        max((torch.tensor(g) - torch.tensor(e)).abs().max().item() for g, e in zip(got, params, strict=True))
        > 1e-7
    ), "compression had no effect: the hook is not active"
