"""The run's device follows `accelerator` and `devices`, resolved (not allocated) when the Trainer is built.

CI has no GPU: `torch.cuda.is_available`/`device_count` pretend two GPUs, and the tests only read the
device the strategy chose; nothing touches CUDA, so the pretence is enough.
"""

from collections import namedtuple
from pathlib import Path

import pytest
import torch
from helpers import Regression, quiet, regression_loader

from strategies import SingleDeviceStrategy
from trainer import Trainer
from trainer.config import build_run, load_recipe
from trainer.core.precision import Precision
from trainer.core.tree import apply_to_tensors
from trainer.flags import device_for

RECIPES = Path(__file__).parents[2] / "recipes"


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine that reports two CUDA devices; LOCAL_RANK unset, as in a plain `python script.py`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


@pytest.mark.parametrize("accelerator", ["cuda", "gpu"])
def test_a_device_list_puts_a_single_process_run_on_that_gpu(two_gpus, accelerator, tmp_path):
    trainer = Trainer(accelerator=accelerator, devices=[1], default_root_dir=tmp_path, **quiet())
    assert isinstance(trainer.strategy, SingleDeviceStrategy)
    assert trainer.strategy.accelerator == "cuda"
    assert trainer.strategy.root_device == torch.device("cuda", 1)


@pytest.mark.parametrize("local_rank, expected", [(None, 0), ("0", 0), ("1", 1)])
def test_single_device_strategy_on_cuda_uses_the_local_rank(two_gpus, monkeypatch, local_rank, expected):
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    strategy = SingleDeviceStrategy()
    strategy.configure("cuda", 1, 1, Precision("bf16-mixed", "cuda"))
    assert strategy.root_device == torch.device("cuda", expected)


def test_gpu_alias_with_a_device_count_uses_the_first_gpu(two_gpus, tmp_path):
    trainer = Trainer(accelerator="gpu", devices=1, default_root_dir=tmp_path, **quiet())
    assert trainer.strategy.root_device == torch.device("cuda", 0)


@pytest.mark.parametrize(
    "devices, match",
    [
        ([0, 0], r"devices=\[0, 0\] is invalid; allowed: a non-empty list of distinct GPU indices in 0..1"),
        ([-1], r"devices=\[-1\] is invalid; allowed: a non-empty list of distinct GPU indices"),
        ([2], r"devices=\[2\] is invalid; allowed: a non-empty list of distinct GPU indices in 0..1"),
        ([], r"devices=\[\] is invalid; allowed: a non-empty list"),
        (["0"], r"devices=\['0'\] is invalid"),
    ],
)
def test_a_bad_device_list_is_named_with_what_is_allowed(two_gpus, devices, match):
    with pytest.raises(ValueError, match=match):
        Trainer(accelerator="cuda", devices=devices)


def test_a_device_list_on_the_cpu_is_refused():
    with pytest.raises(
        ValueError, match=r"devices=\[0\] picks GPUs but accelerator='cpu'; allowed on the CPU: an int >= 1"
    ):
        Trainer(accelerator="cpu", devices=[0])


def test_the_device_of_each_local_rank():
    assert device_for("cuda", None, 3) == torch.device("cuda", 3)
    assert device_for("cuda", [4, 6], 1) == torch.device("cuda", 6)
    assert device_for("cpu", None, 1) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"local rank 2 has no GPU in devices=\[4, 6\]"):
        device_for("cuda", [4, 6], 2)


def test_the_1b_recipe_resolves_to_the_gpu(two_gpus, tmp_path):
    """The bug: `trainer fit recipes/llama_1b.yaml` (accelerator: cuda, strategy: single) ran on the CPU."""
    config = load_recipe(RECIPES / "llama_1b.yaml", [f"trainer.default_root_dir={tmp_path}"])
    trainer = build_run(config)[0]
    assert trainer.strategy.root_device == torch.device("cuda", 0)


def test_a_recipe_may_say_gpu_and_list_its_devices(two_gpus, tmp_path):
    overrides = ["trainer.accelerator=gpu", "trainer.devices=[1]", f"trainer.default_root_dir={tmp_path}"]
    config = load_recipe(RECIPES / "llama_tiny.yaml", overrides)
    assert config["trainer"]["devices"] == [1]
    trainer = build_run(config)[0]
    assert trainer.strategy.root_device == torch.device("cuda", 1)


def test_a_cpu_run_trains_with_its_parameters_on_the_cpu(tmp_path):
    module = Regression()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        **quiet(),
    )
    before = [p.detach().clone() for p in module.parameters()]
    trainer.fit(module, regression_loader())
    assert trainer.strategy.root_device == torch.device("cpu")
    assert {p.device for p in module.parameters()} == {torch.device("cpu")}
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def test_every_tensor_of_a_nested_batch_is_moved_and_other_leaves_kept():
    Pair = namedtuple("Pair", "x y")
    batch = {"ids": torch.ones(2, 3), "pairs": [Pair(torch.zeros(1), "label"), (torch.ones(1), 7)]}
    moved = apply_to_tensors(batch, lambda t: t.to("meta"))
    assert moved["ids"].device.type == "meta" and moved["ids"].shape == (2, 3)
    pair, (tensor, number) = moved["pairs"]
    assert isinstance(pair, Pair) and pair.x.device.type == "meta" and pair.y == "label"
    assert tensor.device.type == "meta" and number == 7
    assert batch["ids"].device.type == "cpu"  # a copy: the input is left as it was
