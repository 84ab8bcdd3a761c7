"""`trainer plan ... --goodput`: the effective training time of restart-from-checkpoint, live recovery and hot
spares at the planned GPUs, 16,384 and 100,000, with its assumptions; its flags refused in one line."""

import pytest
from helpers import REPO

from trainer.cli import main

RECIPE = str(REPO / "recipes" / "llama_8b.yaml")


def projection(capsys, *flags) -> tuple[str, dict[tuple[str, str], list[str]]]:
    assert main(["plan", RECIPE, "--gpus", "64", "--goodput", *flags]) == 0
    out = capsys.readouterr().out
    table = out.split("\ngoodput (", 1)[1].split("\nassumptions:", 1)[0].splitlines()
    rows = {}
    for line in table[2:]:
        if line.startswith("  "):
            gpus, _groups, *rest = line.split()
            rows[(gpus, "seed" if "seed" in line else "llama3")] = rest[-4:]  # every, restart, live, spares
    return out, rows


def percent(cell: str) -> float:
    return float(cell.rstrip("%")) / 100


def test_the_projection_at_16k_and_100k_gpus_with_its_assumptions(capsys):
    out, rows = projection(capsys, "--ft-step-ratio", "1.02")
    assert set(rows) == {
        ("64", "llama3"),
        ("16,384", "llama3"),
        ("100,000", "llama3"),
        ("100,000", "seed"),
    }, out
    every, restart, live, spares = rows[("16,384", "llama3")]
    # issue #53's acceptance at its per-step target (1.02x): live recovery > 95% where restart gives ~90%
    assert 0.88 <= percent(restart) <= 0.95 and percent(live) > 0.95 and percent(spares) >= percent(live), out
    at_100k = rows[("100,000", "llama3")]
    assert percent(at_100k[1]) < percent(restart), "restart loses more as the job grows"
    assert percent(at_100k[2]) > 0.95, out
    assert "replica groups of 8 GPUs" in out, "8B: a node of FSDP holds a replica"
    assert "live recovery beats restart while its step costs under 1.0" in out
    for said in ("466 interruptions (419 unexpected) in 54 days", "Dubey et al. 2024", "section 3.3.4",
                 "one every 30 min at 100,000 GPUs", "relaunch 10 min", "Young/Daly", "stall 0.5s",
                 "rejoin (2.3s)", "every step costs 1.02x", "hot spares"):  # fmt: skip
        assert said in out, said


def test_the_measured_per_step_cost_is_the_default_and_the_flags_reach_the_model(capsys):
    """The default: the measured fixed cost a step (the quorum's wait after the forward, the commit vote, the
    sent state's copy: 0.55 ms) over the planned step (1.03 s for the 8B on 64 GPUs: 1.0005x); a ratio given
    instead, or a larger fixed cost, reaches the model."""
    out, rows = projection(capsys)
    _every, restart, live, _spares = rows[("16,384", "llama3")]
    assert "every step costs 0.55 ms more" in out and "1.0005x of the planned 1.03s step" in out, out
    assert percent(live) > 0.95 > percent(restart), out
    out, given = projection(capsys, "--ft-step-ratio", "1.14")
    assert "every step costs 1.14x (given)" in out and percent(given[("16,384", "llama3")][2]) < percent(
        restart
    ), "1.14x costs more than it saves"
    _, slow = projection(capsys, "--ft-step-ms", "150")  # 1.146x of this step
    assert percent(slow[("16,384", "llama3")][2]) < percent(restart)
    _, slow_restart = projection(capsys, "--restart-min", "30", "--group-gpus", "64", "--job-wide", "0.5")
    _, r30, l30, s30 = slow_restart[("16,384", "llama3")]
    assert percent(r30) < percent(restart) and percent(s30) >= percent(l30)
    _, one_group = projection(capsys, "--group-gpus", "64")
    assert one_group[("64", "llama3")][2:] == ["-", "-"], "one replica group: nothing to recover from"


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("--ft-step-ratio", "0.9", "a finite number >= 1"),
        ("--ft-stall-s", "-1", "a finite number >= 0"),
        ("--ft-step-ms", "-3", "a finite number >= 0"),
        ("--ft-rejoin-s", "nan", "a finite number >= 0"),
        ("--restart-min", "soon", "a finite number >= 0"),
        ("--job-wide", "1.5", "a finite number >= 0 and <= 1"),
        ("--group-gpus", "0", "an int >= 1"),
    ],
)
def test_bad_goodput_flags_are_one_line_errors(capsys, flag, value, allowed):
    with pytest.raises(SystemExit) as exited:
        main(["plan", RECIPE, "--gpus", "64", "--goodput", flag, value])
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"trainer plan: error: argument {flag}: {value!r} is invalid; allowed: {allowed}", last


@pytest.mark.parametrize(
    "stall, said",
    [("590", "beats restart while its step costs under 1.0"), ("590", "and never reaches 95%"),
     ("3000", "live recovery loses to restart even at no per-step cost")],
)  # fmt: skip
def test_the_break_even_line_says_when_live_recovery_cannot_pay(capsys, stall, said):
    # a 590 s stall per failure every 2.8 h: 94.1% at no per-step cost (restart: 93.7%); 3000 s: 70%
    out, _ = projection(capsys, "--ft-stall-s", stall)
    assert said in out, out


def test_an_input_of_the_projection_asks_for_it(capsys):
    """`--ft-step-ratio 1.02` without `--goodput` printed no projection: a flag nothing read."""
    assert main(["plan", RECIPE, "--gpus", "64", "--ft-step-ratio", "1.02"]) == 0
    out = capsys.readouterr().out
    assert "goodput (effective training time" in out and "every step costs 1.02x" in out
