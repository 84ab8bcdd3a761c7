"""Where FSDP keeps a block's parameters during a step, as a user's script trains under FSDPStrategy:
`python tests/scripts/fsdp_reshard_script.py --devices 2 --root DIR --out FILE`. ZeRO-2 and ZeRO-3 train
two steps each, one after the other in the same world; rank 0 writes, per stage, each block's local weight
shape after the forward (in training_step, before the backward) and after the backward."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import quiet, regression_loader  # noqa: E402

from strategies import FSDPStrategy  # noqa: E402
from trainer import Trainer, TrainModule  # noqa: E402
from trainer.core.dtensors import local_part  # noqa: E402


class Blocks(TrainModule):
    """Two Linear blocks (FSDP units of their own) and a head (the root's)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)
        self.seen: dict[str, list] = {"after_forward": [], "after_backward": []}

    def transformer_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.seen["after_forward"].append(self._shapes())
        return loss

    def on_after_backward(self) -> None:
        self.seen["after_backward"].append(self._shapes())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _shapes(self) -> list[list[int]]:
        return [list(local_part(block.weight).shape) for block in self.blocks]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    report = {}
    for stage in (2, 3):
        trainer = Trainer(
            strategy=FSDPStrategy(zero_stage=stage), devices=a.devices, max_steps=2,
            default_root_dir=Path(a.root) / f"zero-{stage}", **quiet(enable_checkpointing=False),
        )  # fmt: skip
        module = Blocks()
        trainer.fit(module, regression_loader(batch_size=4))
        report[stage] = module.seen
    if trainer.is_global_zero:
        Path(a.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
