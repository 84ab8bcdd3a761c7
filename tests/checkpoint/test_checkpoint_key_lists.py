"""A checkpoint that does not fit the model lists up to three keys of each kind, and says " ..." only
when there are more."""

from __future__ import annotations

import pytest
import torch
from helpers import Regression, quiet, regression_loader

from trainer import Trainer
from trainer.checkpoint import CheckpointError


class ThreeMore(Regression):
    """The checkpoint's model plus exactly three keys the checkpoint lacks."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Linear(1, 1)
        self.gain = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.extra(self.net(x)) * self.gain


def test_exactly_three_missing_keys_are_all_listed_without_an_ellipsis(tmp_path):
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    with pytest.raises(CheckpointError) as error:
        Trainer(max_steps=4, default_root_dir=tmp_path, **quiet()).fit(
            ThreeMore(), regression_loader(), ckpt_path=ckpt
        )
    assert str(error.value) == (
        f"checkpoint '{ckpt}' does not fit ThreeMore: missing ['extra.bias', 'extra.weight', 'gain']"
    )
