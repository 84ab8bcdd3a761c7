"""Resuming from a checkpoint of a different model fails with an error naming the checkpoint and the
keys that don't fit, before any weight is loaded."""

from __future__ import annotations

import pytest
import torch
from helpers import Regression, quiet, regression_loader

from trainer import Trainer
from trainer.checkpoint import CheckpointError


def saved_checkpoint(tmp_path):
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    return tmp_path / "checkpoints" / "step-00000002"


class NewHead(Regression):
    """The checkpoint's model with its last layer moved: `net.3` is gone, `head` is new."""

    def __init__(self):
        super().__init__()
        self.net[3] = torch.nn.Identity()
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.net(x))


class Deeper(Regression):
    """The checkpoint's model plus two more layers: four keys the checkpoint lacks."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))

    def forward(self, x):
        return self.extra(self.net(x))


@pytest.mark.parametrize(
    "model, keys",
    [
        (NewHead, "missing ['head.bias', 'head.weight']; unexpected ['net.3.bias', 'net.3.weight']"),
        (Deeper, "missing ['extra.0.bias', 'extra.0.weight', 'extra.1.bias'] ..."),
    ],
)
def test_a_checkpoint_of_another_model_names_the_checkpoint_and_the_keys(tmp_path, model, keys):
    ckpt = saved_checkpoint(tmp_path)
    module = model()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(CheckpointError) as error:
        Trainer(max_steps=4, default_root_dir=tmp_path, **quiet()).fit(
            module, regression_loader(), ckpt_path=ckpt
        )
    assert str(error.value) == f"checkpoint '{ckpt}' does not fit {model.__name__}: {keys}"
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
