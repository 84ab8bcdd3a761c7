"""A strategy whose device is not the CPU (a GPU in a real run) gets the module, every tensor of each batch
and the gradient norm of a step without gradients on that device from the base Strategy's defaults. CI
has no GPU: the strategy here names the meta device, which holds shapes and dtypes but no data."""

from __future__ import annotations

from collections import namedtuple

import torch
from helpers import Regression

from strategies import SingleDeviceStrategy

META = torch.device("meta")


class OnMeta(SingleDeviceStrategy):
    @property
    def root_device(self) -> torch.device:
        return META


def test_the_module_is_moved_to_the_strategy_s_device():
    module = OnMeta().setup_module(Regression())
    assert {p.device for p in module.parameters()} == {META}


def test_every_tensor_of_a_batch_is_moved_to_the_strategy_s_device_and_other_leaves_kept():
    Pair = namedtuple("Pair", "x label")
    batch = {"x": torch.ones(2, 8), "pairs": [Pair(torch.zeros(2, 1), "label"), (torch.ones(2), 7)]}
    moved = OnMeta().batch_to_device(batch)
    assert moved["x"].device == META and moved["x"].shape == (2, 8)
    pair, (tensor, number) = moved["pairs"]
    assert isinstance(pair, Pair) and pair.x.device == META and pair.label == "label"
    assert tensor.device == META and number == 7


def test_a_step_without_gradients_has_its_zero_norm_on_the_strategy_s_device():
    strategy = OnMeta()
    norm = strategy.grad_norm(list(strategy.setup_module(Regression()).parameters()))  # no backward: no .grad
    assert norm.device == META and norm.shape == ()
