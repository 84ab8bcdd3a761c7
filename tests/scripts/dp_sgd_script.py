"""DP-SGD runs shared by tests/dp/test_dp_sgd.py, on 1 process in the test or on N self-spawned CPU
processes (`python dp_sgd_script.py OUT --devices N`). Rank 0 writes OUT/<run>.json for each run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback
from strategies.dp_sgd import DPSGDStrategy
from trainer import Trainer, TrainModule


class Classifier(TrainModule):
    """A user's classifier: LayerNorm, GELU MLP, cross-entropy, logging."""

    def __init__(self, lr: float = 0.5):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_acc", (self(x).argmax(-1) == y).float().mean() if len(y) else 0.0)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Silent(TrainModule):
    """Zero gradients everywhere: what the step applies is the noise alone."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(100, 100)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return (self.layer(x) * 0.0).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


class Grads(Callback):
    """Keeps every step's (noised, averaged) gradient, flattened."""

    def __init__(self):
        self.grads: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.grads.append(torch.cat([p.grad.flatten() for p in module.parameters()]))


def data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    y = torch.arange(n) % 3
    x = torch.randn(n, 10, generator=g) + F.one_hot(y, 10).float() * 2
    return TensorDataset(x, y)


def fit(
    root: Path, devices: int, module: TrainModule, callbacks=(), max_steps: int = 6, batch_size: int = 8,
    checkpoints: bool = False, ckpt_path: str | None = None, **dp,
):  # fmt: skip
    """`batch_size` per process; `checkpoints` saves the end of the fit, `ckpt_path` resumes."""
    torch.manual_seed(0)
    strategy = DPSGDStrategy(**{"noise_multiplier": 1.0, "max_grad_norm": 1.0, "noise_seed": 11, **dp})
    trainer = Trainer(
        strategy=strategy, devices=devices, max_steps=max_steps, default_root_dir=root,
        enable_progress_bar=False, log_every_n_steps=1, callbacks=list(callbacks),
        enable_checkpointing=checkpoints or ckpt_path is not None,
    )  # fmt: skip
    dataset = noise_data() if isinstance(module, Silent) else data()
    trainer.fit(module, DataLoader(dataset, batch_size=batch_size), ckpt_path=ckpt_path)
    return trainer


def noise_data() -> TensorDataset:
    return TensorDataset(torch.randn(64, 100), torch.zeros(64))


def weights(module: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).tolist()


def runs(root: Path, devices: int) -> dict[str, dict]:
    """Same seeds, per-process batch = 8 / devices (the same expected logical batch of 8)."""
    out = {}
    torch.manual_seed(1)
    module = Classifier()
    trainer = fit(root / "train", devices, module, batch_size=8 // devices)
    out["train"] = {"weights": weights(module), "epsilon": trainer.callback_metrics["privacy/epsilon"]}
    grads = Grads()
    fit(root / "noise", devices, Silent(), [grads], max_steps=3, batch_size=16 // devices)
    out["noise"] = {
        "std": [float(g.std()) for g in grads.grads],
        "mean": [float(g.mean()) for g in grads.grads],
    }
    if devices > 1:  # 4 steps here, for tests/dp/test_dp_sgd.py to resume on one process
        fit(root / "resume", devices, Classifier(), max_steps=4, batch_size=4, checkpoints=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--devices", type=int, required=True)
    a = p.parse_args()
    out, devices = a.out, a.devices
    torch.set_num_threads(1)
    result = runs(out, devices)
    if torch.distributed.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
