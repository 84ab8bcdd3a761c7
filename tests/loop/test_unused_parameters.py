"""A parameter that a step's loss does not reach keeps its value in that step, as with plain PyTorch
(`zero_grad(set_to_none=True)`): AdamW's momentum and weight decay don't move it. Models that route
each batch through a subset of their weights (mixture-of-experts, multi-task heads) rely on this."""

from __future__ import annotations

import torch
from helpers import assert_params_close, fit, params, regression_loader

from callbacks import Callback
from trainer import TrainModule


class TwoHeads(TrainModule):
    """Even batches train head `a`, odd ones head `b`."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 1)
        self.b = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        head = self.a if batch_idx % 2 == 0 else self.b
        return torch.nn.functional.mse_loss(head(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class Snapshots(Callback):
    def __init__(self) -> None:
        self.after: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after[trainer.global_step] = (params(module.a), params(module.b))


def test_a_head_the_step_does_not_use_is_left_untouched(tmp_path):
    module, snaps = TwoHeads(), Snapshots()
    a0, b0 = params(module.a), params(module.b)
    fit(module, regression_loader(), tmp_path, 3, callbacks=[snaps], enable_checkpointing=False)
    (a1, b1), (a2, b2), (a3, b3) = snaps.after[1], snaps.after[2], snaps.after[3]
    assert_params_close(b1, b0, atol=0.0)  # step 1 trains a only
    assert_params_close(a2, a1, atol=0.0)  # step 2 trains b only: a has momentum, yet stays
    assert_params_close(b3, b2, atol=0.0)  # step 3 trains a only: b has momentum, yet stays
    assert not torch.equal(a1[0], a0[0]) and not torch.equal(b2[0], b1[0]) and not torch.equal(a3[0], a2[0])
