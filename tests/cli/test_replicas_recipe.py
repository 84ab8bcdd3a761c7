"""`trainer replicas RECIPE fault_tolerance.KEY=VALUE`: the recipe's own fault-tolerance settings
(timeout_s, quorum_timeout_s) reach every group, checked before anything starts; the launcher's settings
(lighthouse, replica_id, ...) are filled in for that check rather than demanded from the user."""

from __future__ import annotations

import pytest
from helpers import SMALL, TINY

from trainer import cli
from trainer.config import load_recipe
from trainer.fault_tolerance import launch

pytest.importorskip("torchft")


def launched(monkeypatch, *argv: str):
    """What `trainer replicas ARGV` would start: (the Launch, the groups' entry), nothing started."""
    seen = []

    def record(how, entry, *rest):
        seen.append((how, entry))
        return 0

    monkeypatch.setattr(launch, "run_replica_groups", record)
    assert cli.main(["replicas", *argv]) == 0
    return seen[0]


def test_a_quorum_timeout_override_reaches_every_group(monkeypatch, tmp_path):
    argv = ["--groups", "2", "--min-replicas", "2", str(TINY), *SMALL, "fault_tolerance.quorum_timeout_s=15"]
    _, entry = launched(monkeypatch, *argv, f"trainer.default_root_dir={tmp_path}")
    for replica in (0, 1):
        argv = entry(replica, "127.0.0.1:29510")
        config = load_recipe(TINY, [item for item in argv[4:] if "=" in item])  # what the group's `fit` reads
        ft = config["fault_tolerance"]
        assert ft["quorum_timeout_s"] == 15 and ft["lighthouse"] == "127.0.0.1:29510"
        assert (ft["replica_id"], ft["replicas"], ft["min_replicas"]) == (replica, 2, 2)


SECONDS = "allowed: a number of seconds > 0"
TOO_LONG = "FaultTolerance timeout_s=1e+30; allowed: a number of seconds > 0, at most 604800"
MISSPELT = "unknown key 'fault_tolerance.quorum_timeut_s'; did you mean 'quorum_timeout_s'"


@pytest.mark.parametrize(
    "override, words",
    [
        (
            "fault_tolerance.quorum_timeout_s=0",
            f"fault_tolerance: FaultTolerance quorum_timeout_s=0; {SECONDS}",
        ),
        ("fault_tolerance.timeout_s=1.0e+30", TOO_LONG),
        ("fault_tolerance.quorum_timeut_s=15", MISSPELT),
    ],
)
def test_a_bad_fault_tolerance_override_is_one_line_before_anything_starts(
    override, words, monkeypatch, capsys
):
    def started(*args):
        raise AssertionError("replica groups were started for a recipe that should have been refused")

    monkeypatch.setattr(launch, "run_replica_groups", started)
    assert cli.main(["replicas", "--groups", "2", str(TINY), *SMALL, override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainer: error: ") and words in err and "\n" not in err, err


def test_a_recipe_with_part_of_the_section_run_by_fit_names_the_missing_keys(capsys):
    assert cli.main(["config", str(TINY), "fault_tolerance.quorum_timeout_s=15"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "trainer: error: fault_tolerance.lighthouse, fault_tolerance.replica_id not set; allowed:"
    )
    assert "trainer replicas" in err and "\n" not in err, err
