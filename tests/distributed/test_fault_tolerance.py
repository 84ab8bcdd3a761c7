"""Per-step fault tolerance on torchft across real processes: two replica groups of one process under a
lighthouse (`trainer lighthouse`), one group SIGKILLed again and again (at the start of a step, during the
gradient all-reduce, after a commit) and relaunched; the survivor trains on alone and the relaunched group
rejoins with the survivor's live state. Checked against a plain-PyTorch replay of the same steps."""

from __future__ import annotations

import json
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ft_script import BATCH, LR, N, params_hash
from helpers import REPO, SCRIPTS, SEED, Regression, launch_env, regression_data

pytestmark = pytest.mark.slow
pytest.importorskip("torchft")

FT_SCRIPT = SCRIPTS / "ft_script.py"
DEADLINE_S = 240  # the whole drill; it takes ~40 s on an idle 2-core machine
ENV = launch_env(RUST_LOG="warn", PYTHONPATH=str(REPO))


def start_lighthouse(root: Path) -> tuple[subprocess.Popen, str]:
    """`trainer lighthouse` on 127.0.0.1 at a port the system picks (a dead group is noticed after 1 s
    without a heartbeat); its address, read from the first line it prints."""
    cmd = [sys.executable, "-m", "trainer.cli", "lighthouse", "--bind", "127.0.0.1:0", "--heartbeat-timeout-ms", "1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(root / "lighthouse.err", "w"), text=True, env=ENV)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    assert line.startswith("lighthouse listening on http://127.0.0.1:"), (line, (root / "lighthouse.err").read_text())
    return proc, line.split("http://")[1].strip()


def start_group(root: Path, lighthouse: str, replica: int, kills: str, attempt: int) -> subprocess.Popen:
    folder = root / f"replica{replica}"
    folder.mkdir(exist_ok=True)
    cmd = [
        sys.executable, str(FT_SCRIPT), "--lighthouse", lighthouse, "--replica-id", str(replica), "--killed", "1",
        "--kills", kills, "--attempt", str(attempt), "--seed", str(SEED), "--step-sleep", "0.01", "--root", str(folder),
        "--out", str(root / f"replica{replica}.json"),
    ]  # fmt: skip
    err = open(folder / f"attempt{attempt}.err", "w")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=ENV)


def steps(root: Path, replica: int) -> list[dict]:
    return [json.loads(line) for line in (root / f"replica{replica}" / "steps.jsonl").read_text().splitlines()]


def replay(rows: list[dict]) -> Regression:
    """The run in one process with plain PyTorch: the same initial model, and per recorded step the mean of
    the participating groups' gradients (group r reads shard r of the data at the recorded position) applied
    by SGD when the step committed; a discarded step changes nothing."""
    torch.manual_seed(SEED)
    model = Regression(lr=LR, optimizer="sgd")
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = regression_data(N).tensors
    shards = [torch.arange(N)[r::2] for r in range(2)]  # DistributedSampler(shuffle=False) of 2
    for row in rows:
        if not row["committed"]:
            continue
        grads = []
        for r in range(row["replicas"]):
            index = shards[r][row["position"] * BATCH : (row["position"] + 1) * BATCH]
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[index]), y[index]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = gs[0] if len(gs) == 1 else (gs[0] + gs[1]) / 2
        sgd.step()
    return model


def wait_for_first_step(root: Path, proc: subprocess.Popen, deadline: float) -> None:
    """Until the group's step log has a row (polling a file, with a deadline)."""
    log = root / "steps.jsonl"
    while not (log.exists() and log.read_text().strip()):
        assert proc.poll() is None, f"the group exited (rc {proc.returncode}) before its first step"
        assert time.monotonic() < deadline, "the first group never took a step"
        time.sleep(0.05)


def test_replica_group_killed_six_times_rejoins_live_and_matches_a_replay(tmp_path):
    rng = random.Random(SEED)  # TRAINER_TEST_SEED=N explores other kill points; a failure prints its seed
    kinds = ["allreduce"] * 5 + ["end"]  # five during the gradient all-reduce, one between steps
    rng.shuffle(kinds)
    kills = ",".join(f"{rng.randint(2, 6)}@{kind}" for kind in kinds)
    print(f"fault tolerance drill: replica group 1 is killed at {kills} (offset from each attempt's first step)")
    deadline = time.monotonic() + DEADLINE_S
    lighthouse, address = start_lighthouse(tmp_path)
    survivor, started = start_group(tmp_path, address, 0, kills, 0), []
    try:
        wait_for_first_step(tmp_path / "replica0", survivor, deadline)  # group 1 joins a running job
        started.append(start_group(tmp_path, address, 1, kills, 0))
        for attempt in range(1, len(kinds) + 1):
            while started[-1].poll() is None:
                assert survivor.poll() is None, f"the survivor died (rc {survivor.returncode}) in outage {attempt}"
                assert time.monotonic() < deadline, f"the drill ran past {DEADLINE_S} s (kill {attempt})"
                time.sleep(0.05)  # polling a process, not synchronising
            assert started[-1].returncode == -signal.SIGKILL, (tmp_path / "replica1" / f"attempt{attempt - 1}.err").read_text()[-3000:]
            started.append(start_group(tmp_path, address, 1, kills, attempt))
        for proc in (survivor, started[-1]):
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert survivor.returncode == 0, (tmp_path / "replica0" / "attempt0.err").read_text()[-3000:]
        assert started[-1].returncode == 0, (tmp_path / "replica1" / f"attempt{len(kinds)}.err").read_text()[-3000:]
    finally:
        for proc in [survivor, *started]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lighthouse.terminate()
        lighthouse.wait(timeout=30)

    alive, killed = steps(tmp_path, 0), steps(tmp_path, 1)
    by_step = {row["step"]: row for row in alive}
    assert [row["step"] for row in alive] == list(range(len(alive))), "the survivor skipped or repeated a step"
    for row in killed:  # every step both groups finished: the same decision and bit-identical parameters
        peer = by_step[row["step"]]
        assert (row["committed"], row["params"]) == (peer["committed"], peer["params"]), (row, peer)
    for attempt in range(1, len(kinds) + 1):  # each outage: the survivor kept committing alone, then the group rejoined
        before = max(r["step"] for r in killed if r["attempt"] == attempt - 1)
        after = min(r["step"] for r in killed if r["attempt"] == attempt)
        alone = [by_step[s] for s in range(before + 1, after)]
        assert any(r["committed"] and r["replicas"] == 1 for r in alone), f"no solo step in outage {attempt}"
        assert by_step[after]["replicas"] == 2, f"group 1 did not rejoin at step {after}"
    final = json.loads((tmp_path / "replica1.json").read_text())
    assert final["hash"] == json.loads((tmp_path / "replica0.json").read_text())["hash"]
    logged = [json.loads(line) for line in (tmp_path / "replica0" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert {row.get("train/replicas") for row in logged} >= {1.0, 2.0}
    # Tolerance 0: the replay runs the same float32 operations in the same order (a two-way all-reduce sums
    # a + b, exact and commutative; one group alone reduces nothing), so parameters and loss agree bit for bit.
    reference = replay(alive)
    assert params_hash(reference) == final["hash"], "the run differs from a replay of the same participants"
    trained = Regression()
    for p, value in zip(trained.parameters(), final["params"]):
        p.data = torch.tensor(value)
    x, y = regression_data(N).tensors
    with torch.no_grad():
        loss, expected = (torch.nn.functional.mse_loss(m(x), y).item() for m in (trained, reference))
    assert loss == expected, (loss, expected)
