"""FSDP's memory features do what they say, measured on what they change (memory, placement), not on
the results, which they must leave alone (test_fsdp.py checks that): a feature that is silently ignored
trains exactly like plain FSDP and passes every result test.

- activation_checkpointing: the bytes the first training forward keeps for the backward. "full"
  recomputes each block, so only what lies outside the blocks is kept; "selective" keeps the matmul and
  attention outputs inside them, so it lies in between.
- cpu_offload: this machine has no accelerator, so every tensor is on the CPU whether or not anything is
  offloaded. What can be observed is FSDP2's own state: each fully_shard-ed module carries a
  CPUOffloadPolicy and every sharded parameter is marked for offload, and shards, gradients and
  optimizer states are CPU tensors.

Each configuration is one 2-rank ZeRO-3 run of the tiny Llama (two blocks) through tests/scripts/fsdp_script.py,
shared by the tests of this module.
"""

from __future__ import annotations

import pytest
from helpers import FSDP_SCRIPT, run_world, script_result

pytestmark = pytest.mark.slow

CONFIGS = {
    "plain": [],
    "full": ["--ac", "full"],
    "selective": ["--ac", "selective"],
    "offload": ["--offload"],
}
BLOCKS = 2  # LLAMA's n_layers: each block and the root are fully_shard-ed


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """name -> rank 0's result of a 2-rank ZeRO-3 Llama run with CONFIGS[name]: all of them one after another
    in one torchrun world, launched once per module."""
    tmp = tmp_path_factory.mktemp("fsdp-memory")
    common = [
        "--stage",
        "3",
        "--model",
        "llama",
        "--steps",
        "1",
        "--report-activations",
        "--report-placement",
    ]
    run_world(2, FSDP_SCRIPT, tmp, CONFIGS, *common)
    results = {name: script_result(tmp, name) for name in CONFIGS}
    assert all(r["world_size"] == 2 for r in results.values())
    return results.__getitem__


def test_full_activation_checkpointing_keeps_a_fraction_of_the_activations(fsdp_run):
    plain, full = fsdp_run("plain")["activations"], fsdp_run("full")["activations"]
    # observed: 1.49 MB saved and 1.76 MB held after the forward without, 0.12 MB and 0.46 MB with
    assert full["saved_bytes"] < plain["saved_bytes"] / 5, (
        f"with activation_checkpointing='full' autograd saved {full['saved_bytes']} bytes outside the "
        f"checkpointed blocks, without it {plain['saved_bytes']}: the blocks are not checkpointed"
    )
    assert full["forward_bytes"] < plain["forward_bytes"] / 2, (
        f"the forward held {full['forward_bytes']} bytes with activation_checkpointing='full', "
        f"{plain['forward_bytes']} without"
    )


def test_selective_checkpointing_keeps_more_than_full_and_less_than_none(fsdp_run):
    plain, full, selective = (fsdp_run(n)["activations"] for n in ("plain", "full", "selective"))
    # the blocks are checkpointed: autograd itself saves nothing inside them ...
    assert selective["saved_bytes"] < plain["saved_bytes"] / 5, (
        f"with activation_checkpointing='selective' autograd saved {selective['saved_bytes']} bytes, "
        f"without it {plain['saved_bytes']}: the blocks are not checkpointed"
    )
    # ... and the policy keeps the matmul/attention outputs: observed 1.15 MB against 0.46 and 1.76 MB
    held = {
        name: r["forward_bytes"] for name, r in (("none", plain), ("full", full), ("selective", selective))
    }
    assert held["full"] < 0.8 * held["selective"] and held["selective"] < 0.8 * held["none"], (
        f"bytes held after the forward: {held}; selective must keep more than full (the saved matmul "
        "outputs) and less than no checkpointing"
    )


@pytest.mark.parametrize("name, offloaded", [("plain", False), ("offload", True)])
def test_cpu_offload_puts_an_offload_policy_on_every_sharded_module(fsdp_run, name, offloaded):
    placement = fsdp_run(name)["placement"]
    # really sharded by fully_shard: every block and the root, every parameter a DTensor shard
    assert placement["sharded_modules"] == BLOCKS + 1, placement
    assert placement["dtensor_params"] == placement["fsdp_params"] == placement["params"] > 0, placement
    expected_policies = BLOCKS + 1 if offloaded else 0
    assert placement["cpu_offload_policies"] == expected_policies, (
        f"cpu_offload={offloaded}: {placement['cpu_offload_policies']} of {BLOCKS + 1} sharded modules "
        "carry a CPUOffloadPolicy"
    )
    assert placement["offloaded_params"] == (placement["params"] if offloaded else 0), placement
    # parameter shards, gradients and optimizer states: on the host
    for key in ("param_devices", "grad_devices", "state_devices"):
        assert placement[key] == ["cpu"], f"{key}: {placement[key]}"
