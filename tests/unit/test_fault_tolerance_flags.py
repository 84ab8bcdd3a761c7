"""`Trainer(fault_tolerance=...)` and the recipe's `fault_tolerance:` section: bad values, a missing torchft
and a strategy that samples its own data fail in one line before anything starts."""

from __future__ import annotations

import sys

import pytest

from strategies.dp_sgd import DPSGDStrategy
from trainer import Trainer
from trainer.config import ConfigError, resolve
from trainer.fault_tolerance import FaultTolerance

LIGHTHOUSE = "127.0.0.1:29510"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"lighthouse": "localhost"}, "lighthouse='localhost'; allowed: 'host:port'"),
        ({"lighthouse": "h:99999"}, "allowed: 'host:port' (port 1-65535)"),
        ({"replica_id": 2}, "replica_id=2 with replicas=2; allowed: 0 to 1"),
        ({"replica_id": -1}, "replica_id=-1; allowed: an int >= 0"),
        ({"replicas": 0}, "replicas=0; allowed: an int >= 1"),
        ({"min_replicas": 3}, "min_replicas=3 exceeds replicas=2; allowed: 1 to 2"),
        ({"timeout_s": 0}, "timeout_s=0; allowed: a number of seconds > 0"),
        ({"quorum_timeout_s": float("inf")}, "quorum_timeout_s=inf; allowed: a number of seconds > 0"),
        ({"bind": "10.0.0.1:29500"}, "bind='10.0.0.1:29500'; allowed: a host name or IP address (no port)"),
        ({"quorum_every": 0}, "quorum_every=0; allowed: an int >= 1"),
        (
            {"max_quorum_interval_s": 0},
            "max_quorum_interval_s=0; allowed: a number of seconds > 0, at most 604800 (a week)",
        ),
        (
            {"quorum_every": 8, "sync_every": 4},
            "quorum_every=8 with sync_every=4; allowed: one of them above 1",
        ),
    ],
)
def test_fault_tolerance_refuses_bad_values_in_one_line(kwargs, says):
    with pytest.raises(ValueError) as err:
        FaultTolerance(**{"lighthouse": LIGHTHOUSE, "replica_id": 0, **kwargs})
    assert says in str(err.value) and "\n" not in str(err.value)


def test_fault_tolerance_accepts_a_url_and_an_ipv6_bind():
    config = FaultTolerance("http://lh:1", 1, bind="::1")
    assert (config.lighthouse_url, config.replica_name) == ("http://lh:1", "replica_1")


def test_trainer_without_torchft_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` now raises ImportError
    with pytest.raises(ImportError) as err:
        Trainer(fault_tolerance=FaultTolerance(LIGHTHOUSE, 0))
    assert "needs torchft" in str(err.value) and "pip install 'trainer[ft]'" in str(err.value)
    assert "\n" not in str(err.value)


def test_trainer_refuses_fault_tolerance_of_another_type_and_with_dp_sgd():
    pytest.importorskip("torchft")
    with pytest.raises(TypeError, match="fault_tolerance=dict; allowed: None or"):
        Trainer(fault_tolerance={"lighthouse": LIGHTHOUSE})
    with pytest.raises(ValueError, match="DPSGDStrategy, which samples its own batches"):
        Trainer(strategy=DPSGDStrategy(noise_multiplier=1.0), fault_tolerance=FaultTolerance(LIGHTHOUSE, 0))


def test_recipe_section_resolves_to_the_flag_and_names_bad_keys():
    section = {"lighthouse": LIGHTHOUSE, "replica_id": 1, "min_replicas": 2}
    resolved = resolve({"fault_tolerance": section})["fault_tolerance"]
    assert FaultTolerance(**resolved) == FaultTolerance(LIGHTHOUSE, 1, min_replicas=2)
    assert "fault_tolerance" not in resolve({})  # a recipe without the section resolves as before
    with pytest.raises(ConfigError, match="unknown key 'fault_tolerance.replica'; did you mean 'replicas'"):
        resolve({"fault_tolerance": {**section, "replica": 1}})
    with pytest.raises(
        ConfigError, match="fault_tolerance: FaultTolerance min_replicas=3 exceeds replicas=2"
    ):
        resolve({"fault_tolerance": {**section, "min_replicas": 3}})


def test_a_no_quorum_error_in_a_group_of_several_processes_keeps_its_own_line():
    # a MeshStrategy with a store (a group of 2+ processes) turns torch's collective timeouts into a line
    # naming the silent ranks; fault tolerance's no-quorum error names quorum_timeout_s and is no such timeout
    from strategies import DDPStrategy
    from trainer.fault_tolerance.config import NoQuorumError

    strategy = DDPStrategy()
    strategy._store = object()
    error = NoQuorumError(
        "fault tolerance: no quorum of min_replicas=2 replica group(s) within quorum_timeout_s=2"
    )

    def fails():
        raise error

    with pytest.raises(NoQuorumError) as raised:
        strategy._run_and_report(fails)
    assert raised.value is error
