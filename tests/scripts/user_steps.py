"""Modules written the way Lightning's docs write them: steps that call `self(x)`, `self.forward(x)` or a
submodule (`self.net(x)`), and log. The model has two declared blocks between root layers, so under
FSDP the step must gather the root's parameters (the first and last Linear) as well as the blocks'."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer import TrainModule

STEPS, GLOBAL_BATCH = 6, 16
# the run every comparison uses, in one process or several: same steps, seed and clipping
FIT = {
    "max_steps": STEPS,
    "gradient_clip_val": 0.5,
    "seed": 0,
    "log_every_n_steps": 1,
    "enable_progress_bar": False,
    "enable_checkpointing": False,
}


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class CallsSelf(TrainModule):
    """The most common pattern: `forward` is the model, the steps call `self(x)`."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 1))
        self.training_steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def transformer_blocks(self) -> list[nn.Module]:
        return [self.net[1], self.net[2]]

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.training_steps += 1
        loss = F.mse_loss(self.predict(x), y)
        self.log("train_mse", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.predict(x), y)
        self.log("val_mse", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class CallsForward(CallsSelf):
    """Steps that call `self.forward(x)` explicitly."""

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


class CallsSubmodule(CallsSelf):
    """Steps that skip `forward` and call the submodule: `self.net(x)`."""

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


MODULES = {"self": CallsSelf, "forward": CallsForward, "net": CallsSubmodule}
