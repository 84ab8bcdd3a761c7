"""DiLoCo across replica groups (`FaultTolerance(sync_every=k)`) on torchft across real processes: two groups
train apart and meet every k steps; one is SIGKILLed inside a window and relaunched, rejoining at a meeting
with its peer's weights and outer momentum; both are relaunched from checkpoints inside a window and go on
with it. Checked against a plain-PyTorch replay of DiLoCo."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from ft_script import BATCH, LR, N, params_hash
from helpers import SEED, Regression, regression_data
from test_fault_tolerance import (  # noqa: F401
    alone,
    groups_ending_well,
    lighthouse,
    running_lighthouse,
    start_group,
    steps,
)

from trainer.fault_tolerance import FaultTolerance

pytestmark = pytest.mark.slow
pytest.importorskip("torchft")

K, OUTER_LR, OUTER_MOMENTUM = 4, 0.7, 0.9  # FaultTolerance's defaults: the paper's outer Nesterov SGD
WARMUP = 2 * K  # sync_warmup_steps: per-step sync for two windows' worth of steps


def replay(rows: list[dict], warmup: int = 0) -> Regression:
    """DiLoCo in one process with plain PyTorch, from the survivor's rows: the first `warmup` steps are
    per-step sync (one SGD step by the participating groups' mean gradient); then per window, each
    participating group (group r reads shard r at the recorded positions) takes its SGD steps from the
    window's start weights; when the meeting committed, Nesterov SGD steps the start weights by the mean of
    the groups' start-minus-own; a discarded meeting leaves them."""
    torch.manual_seed(SEED)
    model = Regression(lr=LR, optimizer="sgd")
    start = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(start, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    x, y = regression_data(N).tensors
    shards = [torch.arange(N)[r::2] for r in range(2)]  # DistributedSampler(shuffle=False) of 2
    window: list[dict] = []
    for row in rows:
        if row["step"] < warmup:
            for p, s in zip(model.parameters(), start, strict=True):
                p.data = s.clone()
            model.zero_grad()
            for r in range(row["replicas"]):
                index = shards[r][row["position"] * BATCH : (row["position"] + 1) * BATCH]
                (torch.nn.functional.mse_loss(model(x[index]), y[index]) / row["replicas"]).backward()
            with torch.no_grad():
                for p, s in zip(model.parameters(), start, strict=True):
                    s.sub_(LR * p.grad)
            continue
        window.append(row)
        if row["synced"] is None:
            continue
        if row["synced"]:
            pseudo = []
            for r in range(window[0]["replicas"]):
                for p, s in zip(model.parameters(), start, strict=True):
                    p.data = s.clone()
                sgd = torch.optim.SGD(model.parameters(), lr=LR)
                for step in window:
                    index = shards[r][step["position"] * BATCH : (step["position"] + 1) * BATCH]
                    model.zero_grad()
                    torch.nn.functional.mse_loss(model(x[index]), y[index]).backward()
                    sgd.step()
                pseudo.append([s - p.detach() for s, p in zip(start, model.parameters(), strict=True)])
            for s, *gs in zip(start, *pseudo, strict=True):
                s.grad = gs[0] if len(gs) == 1 else (gs[0] + gs[1]) / 2
            outer.step()
        window = []
    for p, s in zip(model.parameters(), start, strict=True):
        p.data = s.clone()
    return model


def test_diloco_groups_meet_every_k_steps_survive_a_kill_and_match_a_replay(tmp_path, lighthouse, alone):  # noqa: F811
    first_steps = str(tmp_path / "replica0" / "steps-rank0.jsonl")
    diloco = ["--sync-every", str(K), "--after-rejoin", str(3 * K)]
    relaunched = ["--restarts", "1", "--wait-for", first_steps]
    with groups_ending_well(tmp_path) as groups:  # group 1 dies after its 6th step (inside its 2nd window)
        groups += [
            start_group(tmp_path, lighthouse, 0, "5@end", *diloco),
            start_group(tmp_path, lighthouse, 1, "5@end", *diloco, *relaunched),
        ]
    assert json.loads((tmp_path / "replica1" / "attempts.json").read_text()) == [-signal.SIGKILL, 0]
    alive, killed = steps(tmp_path, 0), steps(tmp_path, 1)
    assert [row["step"] for row in alive] == list(range(len(alive)))
    meetings = [row for row in alive if row["synced"] is not None]
    assert [row["step"] % K for row in meetings] == [K - 1] * len(meetings)  # only at a window's last step
    assert {row["replicas"] for row in alive} == {1, 2}
    rejoined = [row for row in killed if row["attempt"] == 1]
    assert rejoined[0]["step"] % K == 0 and rejoined[0]["replicas"] == 2  # it rejoined at a meeting
    by_step = {row["step"]: row for row in alive}
    for row in killed:  # after every meeting both took part in: bit-identical parameters
        if row["synced"] and by_step[row["step"]]["replicas"] == 2:
            assert row["params"] == by_step[row["step"]]["params"], row
    final = json.loads((tmp_path / "replica0.json").read_text())
    assert final["hash"] == json.loads((tmp_path / "replica1.json").read_text())["hash"]
    reference = replay(alive)
    got = torch.cat([torch.tensor(p).reshape(-1) for p in final["params"]])
    want = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert params_hash(reference) != params_hash(Regression())  # it trained


def test_groups_relaunched_from_checkpoints_inside_a_window_continue_it(tmp_path, alone):  # noqa: F811
    """Both groups stop after step 6 (inside the second window of 4, after one meeting), each saving a
    checkpoint; both are relaunched from them and train to step 12. The window's start weights and the outer
    momentum come back from the checkpoints: the run is the uninterrupted one's (the replay's). A lighthouse
    of min_replicas=2 makes every quorum wait for both groups."""
    diloco = ["--sync-every", str(K), "--after-rejoin", "1000"]
    with running_lighthouse(tmp_path, "--min-replicas", "2") as address:
        for leg in (["--max-steps", "6", "--save-at", "6"], ["--max-steps", "12"]):
            with groups_ending_well(tmp_path) as groups:
                for replica in range(2):
                    resume = ["--resume", str(tmp_path / f"replica{replica}" / "checkpoint")]
                    groups.append(
                        start_group(
                            tmp_path, address, replica, "", *diloco, *leg, *(resume if "12" in leg else [])
                        )
                    )
    rows = steps(tmp_path, 0)
    assert [row["step"] for row in rows] == list(range(12))
    assert {row["replicas"] for row in rows} == {2}
    assert [row["step"] for row in rows if row["synced"]] == [3, 7, 11]
    final = json.loads((tmp_path / "replica0.json").read_text())
    assert final["hash"] == json.loads((tmp_path / "replica1.json").read_text())["hash"]
    got = torch.cat([torch.tensor(p).reshape(-1) for p in final["params"]])
    want = torch.cat([p.detach().reshape(-1) for p in replay(rows).parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("save_at", [WARMUP // 2, WARMUP, WARMUP + 2])
def test_a_per_step_warm_up_then_windows_also_across_a_relaunch(tmp_path, alone, save_at):  # noqa: F811
    """`sync_warmup_steps`: the groups average every step's gradients for the first WARMUP steps (bit-equal
    parameters after each), then meet every K steps; both stop after `save_at` steps (inside the warm-up,
    at its end, inside the first window), saving checkpoints, and are relaunched from them: the run is the
    uninterrupted replay's (with the paper's outer 0.7 / Nesterov 0.9, a first window started from other
    weights than the warm-up's last would show)."""
    diloco = ["--sync-every", str(K), "--sync-warmup-steps", str(WARMUP), "--after-rejoin", "1000"]
    end = WARMUP + 2 * K
    with running_lighthouse(tmp_path, "--min-replicas", "2") as address:
        for leg in (["--max-steps", str(save_at), "--save-at", str(save_at)], ["--max-steps", str(end)]):
            with groups_ending_well(tmp_path) as groups:
                for replica in range(2):
                    resume = ["--resume", str(tmp_path / f"replica{replica}" / "checkpoint")]
                    relaunched = resume if str(end) in leg else []
                    groups.append(start_group(tmp_path, address, replica, "", *diloco, *leg, *relaunched))
    rows, theirs = steps(tmp_path, 0), steps(tmp_path, 1)
    assert [row["step"] for row in rows] == list(range(end))
    assert {row["replicas"] for row in rows} == {2}
    assert [row["step"] for row in rows if row["synced"]] == [WARMUP + K - 1, end - 1]
    assert [row["params"] for row in rows[:WARMUP]] == [row["params"] for row in theirs[:WARMUP]]
    assert rows[WARMUP]["params"] != theirs[WARMUP]["params"]  # the first window: each group its own
    final = json.loads((tmp_path / "replica0.json").read_text())
    assert final["hash"] == json.loads((tmp_path / "replica1.json").read_text())["hash"]
    got = torch.cat([torch.tensor(p).reshape(-1) for p in final["params"]])
    want = torch.cat([p.detach().reshape(-1) for p in replay(rows, WARMUP).parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("averaged", "combined"), [(False, False), (True, False), (True, True)])
def test_the_inner_adamw_state_is_each_groups_own_or_averaged_at_meetings(
    tmp_path,
    alone,  # noqa: F811
    averaged,
    combined,
):
    """Inner AdamW: each group's optimizer state lives on across meetings (never reset); with
    `sync_optimizer_state` its moments take the groups' mean at each meeting, and with
    `sync_combined_second_moment` the second moment then becomes the two groups' combined batch's,
    m^2 + (v - m^2) / 2. Checked against a replay with one persistent AdamW per group; both groups take part
    in every step (a lighthouse of min 2)."""
    extra = [
        "--sync-every",
        str(K),
        "--after-rejoin",
        "1000",
        "--max-steps",
        str(3 * K),
        "--optimizer",
        "adamw",
    ]
    extra += ["--sync-optimizer-state"] if averaged else []
    extra += ["--sync-combined-second-moment"] if combined else []
    with running_lighthouse(tmp_path, "--min-replicas", "2") as address:
        with groups_ending_well(tmp_path) as groups:
            groups += [start_group(tmp_path, address, replica, "", *extra) for replica in range(2)]
    rows = steps(tmp_path, 0)
    assert [row["step"] for row in rows if row["synced"]] == [K - 1, 2 * K - 1, 3 * K - 1]
    torch.manual_seed(SEED)
    models = [Regression(lr=LR) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    inner = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    start = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(start, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    x, y = regression_data(N).tensors
    for window in (rows[i : i + K] for i in range(0, len(rows), K)):
        for r, (model, adamw) in enumerate(zip(models, inner, strict=True)):
            for p, s in zip(model.parameters(), start, strict=True):
                p.data.copy_(s)
            for row in window:
                index = torch.arange(N)[r::2][row["position"] * BATCH : (row["position"] + 1) * BATCH]
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x[index]), y[index]).backward()
                adamw.step()
        for s, *ps in zip(start, *(m.parameters() for m in models), strict=True):
            s.grad = ((s - ps[0]) + (s - ps[1])).detach() / 2
        outer.step()
        if averaged:
            for pair in zip(*(m.parameters() for m in models), strict=True):
                for key in ("exp_avg", "exp_avg_sq"):
                    mean = (inner[0].state[pair[0]][key] + inner[1].state[pair[1]][key]) / 2
                    for adamw, p in zip(inner, pair, strict=True):
                        adamw.state[p][key].copy_(mean)
                if combined:
                    for adamw, p in zip(inner, pair, strict=True):
                        m, v = adamw.state[p]["exp_avg"], adamw.state[p]["exp_avg_sq"]
                        v.copy_(m * m + (v - m * m).clamp(min=0) / 2)
    final = json.loads((tmp_path / "replica0.json").read_text())
    got = torch.cat([torch.tensor(p).reshape(-1) for p in final["params"]])
    torch.testing.assert_close(got, torch.cat([s.reshape(-1) for s in start]), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("sync_every", 0, "an int >= 1"),
        ("outer_lr", -1.0, "a number >= 0"),
        ("outer_momentum", 1.0, "a number >= 0 and < 1"),
        ("sync_optimizer_state", "yes", "True or False"),
        ("sync_warmup_steps", -4, "an int >= 0"),
        ("sync_combined_second_moment", 1, "True or False"),
    ],
)
def test_bad_diloco_settings_are_named_in_one_line(field, value, allowed):
    with pytest.raises(ValueError, match=rf"FaultTolerance {field}={value!r}; allowed: {allowed}"):
        FaultTolerance(lighthouse="127.0.0.1:1", replica_id=0, **{field: value})


def test_averaging_the_optimizer_state_needs_diloco():
    with pytest.raises(
        ValueError, match=r"sync_optimizer_state=True with sync_every=1; allowed: sync_every > 1"
    ):
        FaultTolerance(lighthouse="127.0.0.1:1", replica_id=0, sync_optimizer_state=True)
    assert FaultTolerance(lighthouse="127.0.0.1:1", replica_id=0, sync_every=2, sync_optimizer_state=True)


def test_the_combined_second_moment_needs_the_averaged_optimizer_state():
    with pytest.raises(
        ValueError,
        match=r"sync_combined_second_moment=True with sync_optimizer_state=False; allowed: sync_optimizer_state=True",
    ):
        FaultTolerance(lighthouse="127.0.0.1:1", replica_id=0, sync_every=2, sync_combined_second_moment=True)
    assert FaultTolerance(
        lighthouse="127.0.0.1:1",
        replica_id=0,
        sync_every=2,
        sync_optimizer_state=True,
        sync_combined_second_moment=True,
    )


def test_a_warm_up_is_a_multiple_of_the_window_of_diloco():
    for sync_every, warmup in ((4, 6), (1, 4)):
        with pytest.raises(
            ValueError,
            match=rf"sync_warmup_steps={warmup} with sync_every={sync_every}; allowed: 0, or a multiple of",
        ):
            FaultTolerance(
                lighthouse="127.0.0.1:1", replica_id=0, sync_every=sync_every, sync_warmup_steps=warmup
            )
    assert FaultTolerance(lighthouse="127.0.0.1:1", replica_id=0, sync_every=4, sync_warmup_steps=8)
