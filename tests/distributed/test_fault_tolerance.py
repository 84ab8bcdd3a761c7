"""Per-step fault tolerance on torchft across real processes: two replica groups of one process under a
lighthouse (`trainer lighthouse`), one group SIGKILLed again and again (at the start of a step, during the
gradient all-reduce, after a commit) and relaunched; the survivor trains on alone and the relaunched group
rejoins with the survivor's live state. Checked against a plain-PyTorch replay of the same steps."""

from __future__ import annotations

import contextlib
import json
import random
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ft_script import BATCH, LR, N, params_hash
from helpers import (
    SCRIPTS,
    SEED,
    WIDE,
    Process,
    Regression,
    launch_env,
    rank_slots,
    regression_data,
    start_process,
)

pytestmark = pytest.mark.slow
pytest.importorskip("torchft")

FT_SCRIPT = SCRIPTS / "ft_script.py"
DEADLINE_S = 240  # each group's run; the drill takes ~40 s on a loaded 2-core machine
ENV = launch_env()


@pytest.fixture
def alone():
    """A drill's groups (and their restarts) run beside no other launch of two or more processes (one process,
    like an in-process test, is no more load than the machine has room for): a heartbeat missed on an
    oversubscribed machine would read as a lost group."""
    with rank_slots(WIDE):
        yield


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory) -> Iterator[str]:
    """`trainer lighthouse` on 127.0.0.1 at a port the system picks, with its default heartbeat timeout
    (HEARTBEAT_TIMEOUT_MS: a dead group is noticed after 0.5 s without a heartbeat), for this module's tests."""
    with running_lighthouse(tmp_path_factory.mktemp("lighthouse")) as address:
        yield address


@contextlib.contextmanager
def running_lighthouse(root: Path, *options: str) -> Iterator[str]:
    """`trainer lighthouse --bind 127.0.0.1:0 OPTIONS` while the block runs; its address, read from the
    first line it prints."""
    cmd = [sys.executable, "-m", "trainer.cli", "lighthouse", "--bind", "127.0.0.1:0", *options]
    proc = start_process(cmd, stdout=subprocess.PIPE, stderr=open(root / "stderr", "w"), text=True, env=ENV)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("lighthouse listening on http://127.0.0.1:"), (
            line,
            (root / "stderr").read_text(),
        )
        yield line.split("http://")[1].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def groups_ending_well(root: Path) -> Iterator[list[Process]]:
    """The replica groups the block starts (appended to the list), each then waited for and required to exit
    0 within DEADLINE_S; whatever fails, none is left running."""
    groups: list[Process] = []
    try:
        yield groups
        for replica, proc in enumerate(groups):
            proc.wait(timeout=DEADLINE_S)
            assert proc.returncode == 0, (root / f"replica{replica}" / "stderr").read_text()[-3000:]
    finally:
        for proc in groups:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def start_group(
    root: Path,
    lighthouse: str,
    replica: int,
    kills: str,
    *extra: str,
    restarts: int | None = None,
    strategy: str = "fsdp",
) -> Process:
    """Replica group `replica` of ft_script.py: one process, or (`restarts` given) a torchrun job of 2
    `strategy` (FSDP or DDP) ranks that torchrun restarts up to that many times."""
    folder = root / f"replica{replica}"
    folder.mkdir(exist_ok=True)
    launcher = [sys.executable]
    if restarts is not None:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                     f"--max-restarts={restarts}"]  # fmt: skip
        extra = (*extra, "--group-strategy", strategy)
    cmd = [
        *launcher, str(FT_SCRIPT), "--lighthouse", lighthouse, "--replica-id", str(replica), "--killed", "1",
        "--kills", kills, "--seed", str(SEED), "--step-sleep", "0.01", "--root", str(folder),
        "--out", str(root / f"replica{replica}.json"), *extra,
    ]  # fmt: skip
    return start_process(cmd, stdout=subprocess.DEVNULL, stderr=open(folder / "stderr", "w"), env=ENV)


def steps(root: Path, replica: int, rank: int = 0) -> list[dict]:
    log = root / f"replica{replica}" / f"steps-rank{rank}.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()]


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
        for p, *gs in zip(model.parameters(), *grads, strict=True):
            p.grad = gs[0] if len(gs) == 1 else (gs[0] + gs[1]) / 2
        sgd.step()
    return model


@pytest.mark.parametrize("quorum_every", [1, 4])
def test_replica_group_killed_six_times_rejoins_live_and_matches_a_replay(
    tmp_path, lighthouse, alone, quorum_every
):
    rng = random.Random(SEED)  # TRAINER_TEST_SEED=N explores other kill points; a failure prints its seed
    kinds = ["allreduce"] * 5 + ["end"]  # five during the gradient all-reduce, one between steps
    rng.shuffle(kinds)
    kills = ",".join(f"{rng.randint(2, 6)}@{kind}" for kind in kinds)
    print(
        f"fault tolerance drill: replica group 1 is killed at {kills} (offset from each attempt's first step)"
    )
    address = lighthouse
    # group 1 joins the running job once group 0 took a step, then is killed and relaunched len(kinds) times
    first_steps = str(tmp_path / "replica0" / "steps-rank0.jsonl")
    relaunched = ["--restarts", str(len(kinds)), "--wait-for", first_steps]
    cadence = ("--quorum-every", str(quorum_every))
    with groups_ending_well(tmp_path) as groups:
        groups += [
            start_group(tmp_path, address, 0, kills, *cadence),
            start_group(tmp_path, address, 1, kills, *relaunched, *cadence),
        ]
    attempts = json.loads((tmp_path / "replica1" / "attempts.json").read_text())
    assert attempts == [-signal.SIGKILL] * len(kinds) + [0], attempts

    alive, killed = steps(tmp_path, 0), steps(tmp_path, 1)
    by_step = {row["step"]: row for row in alive}
    assert [row["step"] for row in alive] == list(range(len(alive))), (
        "the survivor skipped or repeated a step"
    )
    asked = sum(row["quorum"] for row in alive)  # quorum_every=4: the 4th steps, and those after a failure
    assert asked == len(alive) if quorum_every == 1 else asked < len(alive) / 2, (asked, len(alive))
    for row in killed:  # every step both groups finished: the same decision and bit-identical parameters
        peer = by_step[row["step"]]
        assert (row["committed"], row["params"]) == (peer["committed"], peer["params"]), (row, peer)
    for attempt in range(
        1, len(kinds) + 1
    ):  # each outage: the survivor kept committing alone, then the group rejoined
        before = max(r["step"] for r in killed if r["attempt"] == attempt - 1)
        after = min(r["step"] for r in killed if r["attempt"] == attempt)
        alone = [by_step[s] for s in range(before + 1, after)]
        assert any(r["committed"] and r["replicas"] == 1 for r in alone), f"no solo step in outage {attempt}"
        assert by_step[after]["replicas"] == 2, f"group 1 did not rejoin at step {after}"
    final = json.loads((tmp_path / "replica1.json").read_text())
    assert final["hash"] == json.loads((tmp_path / "replica0.json").read_text())["hash"]
    logged = [
        json.loads(line)
        for line in (tmp_path / "replica0" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert {row.get("train/replicas") for row in logged} >= {1.0, 2.0}
    # Tolerance 0: the replay runs the same float32 operations in the same order (a two-way all-reduce sums
    # a + b, exact and commutative; one group alone reduces nothing), so parameters and loss agree bit for bit.
    reference = replay(alive)
    assert params_hash(reference) == final["hash"], "the run differs from a replay of the same participants"
    trained = Regression()
    for p, value in zip(trained.parameters(), final["params"], strict=True):
        p.data = torch.tensor(value)
    x, y = regression_data(N).tensors
    with torch.no_grad():
        loss, expected = (torch.nn.functional.mse_loss(m(x), y).item() for m in (trained, reference))
    assert loss == expected, (loss, expected)


def test_a_sigkilled_peer_costs_the_survivor_one_step_and_no_long_wait(tmp_path, lighthouse, alone):
    """Group 1 is SIGKILLed in place of its part of a step's gradient all-reduce (then relaunched). The
    survivor's all-reduce fails on the closed connection, not on its `timeout_s` (20 s): that step, and no
    other, is discarded, and the reason logged is gloo's connection error. Its next quorum forms once the dead
    group's heartbeat runs out (HEARTBEAT_TIMEOUT_MS), well inside a quorum_timeout_s of 3 s (the 5 s heartbeat
    timeout of old ends the fit), and that step commits alone."""
    from trainer.fault_tolerance.config import HEARTBEAT_TIMEOUT_MS

    assert HEARTBEAT_TIMEOUT_MS * 6 <= 3000
    offset = random.Random(SEED).randint(2, 6)
    first_steps = str(tmp_path / "replica0" / "steps-rank0.jsonl")
    kills, quick = f"{offset}@allreduce", ("--quorum-timeout", "3")
    relaunched = ("--restarts", "1", "--wait-for", first_steps)
    with groups_ending_well(tmp_path) as groups:
        groups += [
            start_group(tmp_path, lighthouse, 0, kills, *quick),
            start_group(tmp_path, lighthouse, 1, kills, *quick, *relaunched),
        ]
    alive, killed = steps(tmp_path, 0), steps(tmp_path, 1)
    died = max(r["step"] for r in killed if r["attempt"] == 0) + 1  # the step group 1 did not finish
    discarded = [r["step"] for r in alive if not r["committed"]]
    assert discarded == [died], (discarded, died)
    after = next(r for r in alive if r["step"] == died + 1)
    assert (after["committed"], after["replicas"]) == (True, 1), after
    logged = [
        line
        for line in (tmp_path / "replica0" / "stderr").read_text().splitlines()
        if "fault tolerance: replica group 0 discarded step" in line
    ]
    assert len(logged) == 1 and f"discarded step {died}: " in logged[0], logged
    assert "gloo" in logged[0] and "Timed out" not in logged[0], logged[0]


@pytest.mark.parametrize("quorum_every, group", [(1, None), (8, None), (8, "fsdp"), (8, "ddp")])
def test_a_group_that_skips_a_step_its_peer_commits_heals_at_the_next_quorum(
    tmp_path, lighthouse, alone, quorum_every, group
):
    """Group 1 skips its update at one step (a callback's skip: its vote is its own) while group 0 commits
    it. Group 1 is then one applied update behind, and the next quorum heals it from group 0: from that step
    on both hold bit-identical parameters (before, it went on with the update missing, unnoticed). With a
    quorum every 8 steps, the flags summed in the next step's all-reduce show group 1 out of step: both
    groups discard that step, and the one after takes a quorum where group 1 heals; also in groups of 2
    FSDP or DDP ranks (`group`): flags summed after a shard's (a bucket's) sum, each rank deciding by the
    group's vote (DDP's: summed around the group's ring with the last bucket, the skip added at the vote)."""
    offset = random.Random(SEED).randint(2, 6)
    first_steps = str(tmp_path / "replica0" / "steps-rank0.jsonl")
    common = (
        "--skip-at",
        str(offset),
        "--after-rejoin",
        str(offset + 4),
        "--quorum-every",
        str(quorum_every),
    )
    ranks = {"restarts": 0, "strategy": group} if group else {}
    with groups_ending_well(tmp_path) as groups:
        groups += [
            start_group(tmp_path, lighthouse, 0, "", *common, **ranks),
            start_group(tmp_path, lighthouse, 1, "", *common, "--wait-for", first_steps, **ranks),
        ]
    for rank in (0, 1) if group else (0,):
        _skip_healed(tmp_path, rank, offset, quorum_every)


def _skip_healed(tmp_path: Path, rank: int, offset: int, quorum_every: int) -> None:
    """What `test_a_group_that_skips_a_step_its_peer_commits_heals_at_the_next_quorum` reads on `rank`."""
    alive, skipper = steps(tmp_path, 0, rank), steps(tmp_path, 1, rank)
    by_step = {row["step"]: row for row in alive}
    skipped = skipper[0]["step"] + offset
    heal = skipped + 1 if (skipped + 1) % quorum_every == 0 else skipped + 2  # quorum_every=1: the next
    both = list(range(skipped + 1, heal))  # the steps both groups discard (the flags disagreed)
    assert [r["step"] for r in skipper if not r["committed"]] == [skipped, *both]
    assert [r["step"] for r in alive if not r["committed"]] == both
    assert by_step[skipped]["committed"] and by_step[skipped]["replicas"] == 2
    assert by_step[heal]["quorum"] and (quorum_every == 1 or not all(r["quorum"] for r in alive))
    for row in skipper:
        if not skipped <= row["step"] < heal:
            assert row["params"] == by_step[row["step"]]["params"], (row, by_step[row["step"]])
    assert any(r["step"] > heal for r in skipper), "the run ended before it showed the heal"
    recovered = f"replica group 1 recovered from a peer at step {heal}"
    assert recovered in (tmp_path / "replica1" / "stderr").read_text()


def test_a_group_joins_within_max_quorum_interval_s_when_its_peers_quorum_is_many_steps_away(
    tmp_path, lighthouse, alone
):
    """Group 0 trains with a quorum every 100,000 steps; group 1 starts after group 0's first step and asks
    to join. The lighthouse holds group 1's quorum until group 0 asks: group 0's last quorum grows older than
    max_quorum_interval_s (0.2 s), it wishes for one in the step's sums, and asks at the next step. The two
    train on together bit-identical, every later quorum at the same steps in both (without the bound group
    0 would not ask again: group 1 would wait for the lighthouse's 60 s join timeout, then train alone)."""
    common = ("--quorum-every", "100000", "--max-quorum-interval", "0.2", "--after-rejoin", "30")
    first_steps = str(tmp_path / "replica0" / "steps-rank0.jsonl")
    with groups_ending_well(tmp_path) as groups:
        groups += [
            start_group(tmp_path, lighthouse, 0, "", *common),
            start_group(tmp_path, lighthouse, 1, "", *common, "--wait-for", first_steps),
        ]
    alive, joiner = steps(tmp_path, 0), steps(tmp_path, 1)
    by_step = {row["step"]: row for row in alive}
    joined = joiner[0]["step"]
    assert joiner[0]["quorum"] and joiner[0]["replicas"] == 2, joiner[0]
    assert by_step[joined]["quorum"] and by_step[joined]["replicas"] == 2, by_step[joined]
    # every quorum after group 0's first came from the bound: no step failed or was discarded
    assert all(r["committed"] for r in alive + joiner), [r for r in alive + joiner if not r["committed"]]
    for row in joiner:
        assert (row["quorum"], row["params"], row["committed"]) == (
            by_step[row["step"]]["quorum"],
            by_step[row["step"]]["params"],
            by_step[row["step"]]["committed"],
        ), (row, by_step[row["step"]])
    later = [r["step"] for r in joiner[1:] if r["quorum"]]
    assert later and all(by_step[s]["quorum"] for s in later), later  # 30 steps of >= 10 ms: >= 0.3 s


@pytest.mark.parametrize("strategy, quorum_every", [("fsdp", 1), ("fsdp", 4), ("ddp", 1), ("ddp", 4)])
def test_replica_groups_of_2_ranks_survive_a_rank_killed_during_the_all_reduce(
    tmp_path, lighthouse, alone, strategy, quorum_every
):
    """Two groups of 2 FSDP (or DDP) ranks, each a torchrun job; rank 1 of group 1 dies during the gradient
    all-reduce and torchrun restarts the group, which rejoins: every rank's shards (DDP: weights) equal its
    peer rank's. With a quorum every 4 steps only rank 1 of the survivor sees its all-reduce fail (rank 0's
    peer is alive until torchrun stops it): the group's vote makes both ranks ask for the next quorum. DDP: the
    restarted group's first backward fills DDP's first-iteration bucket layout (one bucket), its peer's the
    rebuilt one; summed bucket by bucket, the rejoined group's weights differed from its peer's."""
    offset = random.Random(SEED).randint(2, 6)
    common = ("--kill-rank", "1", "--quorum-every", str(quorum_every))
    first_steps = str(tmp_path / "replica0" / "steps-rank0.jsonl")
    with groups_ending_well(tmp_path) as groups:
        groups += [  # group 1 joins the running job (it waits for the survivor's first step)
            start_group(tmp_path, lighthouse, 0, f"{offset}@allreduce", *common, restarts=0, strategy=strategy),
            start_group(tmp_path, lighthouse, 1, f"{offset}@allreduce", *common, "--wait-for", first_steps,
                        restarts=1, strategy=strategy),
        ]  # fmt: skip
    for rank in (0, 1):
        alive, killed = steps(tmp_path, 0, rank), steps(tmp_path, 1, rank)
        by_step = {row["step"]: row for row in alive}
        assert [row["step"] for row in alive] == list(range(len(alive))), f"rank {rank} skipped a step"
        for row in killed:
            peer = by_step[row["step"]]
            assert (row["committed"], row["params"]) == (peer["committed"], peer["params"]), (rank, row, peer)
        before = max(r["step"] for r in killed if r["attempt"] == 0)
        after = min(r["step"] for r in killed if r["attempt"] == 1)
        assert any(by_step[s]["committed"] and by_step[s]["replicas"] == 1 for s in range(before + 1, after))
        assert by_step[after]["replicas"] == 2 and by_step[before + 1]["committed"] is False


def test_fewer_live_groups_than_the_quorum_needs_end_the_fit_in_one_line(tmp_path):
    """A lighthouse that needs 2 groups and only one alive: after quorum_timeout_s the fit ends with one line."""
    from helpers import regression_loader

    from trainer import Trainer
    from trainer.fault_tolerance import FaultTolerance
    from trainer.fault_tolerance.lighthouse import start_lighthouse

    server = start_lighthouse("127.0.0.1:0", min_replicas=2)
    address = f"127.0.0.1:{server.address().rpartition(':')[2]}"
    config = FaultTolerance(address, 0, min_replicas=2, quorum_timeout_s=2)
    trainer = Trainer(
        max_steps=2, default_root_dir=tmp_path, enable_progress_bar=False, fault_tolerance=config
    )
    try:
        with pytest.raises(RuntimeError) as err:
            trainer.fit(Regression(optimizer="sgd"), regression_loader())
    finally:
        server.shutdown()
    assert str(err.value).startswith(
        f"fault tolerance: no quorum of min_replicas=2 replica group(s) within quorum_timeout_s=2 at lighthouse {address}"
    ), str(err.value)
    assert "\n" not in str(err.value)
    # a script that does not catch it shows one exception, not torchft's multi-line one chained to it
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_a_one_process_groups_commit_vote_is_its_own_with_no_round_trip(tmp_path):
    """A group of one process takes torchft's commit vote as its own (OwnVote): no call to its manager
    server, and torchft still follows it (a step a callback skips is not committed, the others are)."""
    from helpers import regression_loader

    from callbacks import Callback
    from trainer import Trainer
    from trainer.fault_tolerance import FaultTolerance
    from trainer.fault_tolerance.group_calls import OwnVote
    from trainer.fault_tolerance.lighthouse import start_lighthouse

    class ServerVoteRefused:
        def __init__(self, client) -> None:
            self._quorum = client._quorum  # the quorum still goes to the server

        def should_commit(self, *args, **kwargs):
            raise AssertionError("the commit vote went to the manager server")

    committed: list[int] = []

    class SkipStepTwo(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            client = trainer._fit_loop.replicas.manager._client
            assert isinstance(client, OwnVote)
            if not isinstance(client.client, ServerVoteRefused):
                client.client = ServerVoteRefused(client.client)

        def on_before_optimizer_step(self, trainer, module, optimizer):
            if trainer.global_step == 2:
                trainer.skip_optimizer_step("a test's skip")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            committed.append(trainer._fit_loop.replicas.manager.batches_committed())

    server = start_lighthouse("127.0.0.1:0")
    address = f"127.0.0.1:{server.address().rpartition(':')[2]}"
    trainer = Trainer(
        max_steps=4, default_root_dir=tmp_path, enable_progress_bar=False, callbacks=[SkipStepTwo()],
        fault_tolerance=FaultTolerance(address, 0, replicas=1),
    )  # fmt: skip
    try:
        trainer.fit(Regression(optimizer="sgd"), regression_loader())
    finally:
        server.shutdown()
    assert committed == [1, 2, 2, 3]


def test_a_quorum_every_k_steps_is_refused_in_one_line_where_the_average_carries_no_flag(tmp_path):
    """quorum_every's flag rides the overlapped average's sums over the groups: a group of one process whose
    parameters FSDP2 shards (its average is a flat one after the backward) is refused before its manager
    starts."""
    from helpers import regression_loader

    from trainer import Trainer
    from trainer.fault_tolerance import FaultTolerance

    config = FaultTolerance("127.0.0.1:1", 0, quorum_every=8)  # no lighthouse is reached
    trainer = Trainer(
        strategy="fsdp",
        max_steps=2,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        fault_tolerance=config,
    )
    with pytest.raises(ValueError) as err:
        trainer.fit(Regression(optimizer="sgd"), regression_loader())
    assert str(err.value).startswith(
        "FaultTolerance quorum_every=8 with replica groups of 1 process(es) under"
    ), err
    allowed = "allowed: quorum_every=1, or groups whose backward averages over the groups: one process with "
    assert allowed + "whole (unsharded) parameters, DDP or FSDP2" in str(err.value)
