"""`Trainer(compile=...)` as a user sets it: compiled training equals eager training on one process and
under DDP and FSDP (real gloo groups), graph breaks and recompiles are said once, bad values are named."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import DDP_SCRIPT, FSDP_SCRIPT, fit, read_metrics, run_script, token_loader
from test_fsdp import single_llama
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from strategies import Parallel3DStrategy
from strategies.dp_sgd import DPSGDStrategy
from trainer import Trainer, TrainModule
from trainer.config import ConfigError, build_run, load_recipe
from trainer.models.causal_lm import CausalLM
from trainer.models.llama import LlamaConfig

RECIPE = Path(__file__).parents[2] / "recipes" / "llama_tiny.yaml"
TINY = LlamaConfig.preset("tiny", vocab_size=64, max_seq_len=32)


def llama_losses(tmp_path, name: str, **flags) -> dict[int, float]:
    torch.manual_seed(0)
    model, data = CausalLM(TINY, lr=3e-3), token_loader(4, vocab_size=64)
    fit(model, data, tmp_path / name, 20, gradient_clip_val=1.0, enable_checkpointing=False, **flags)
    return read_metrics(tmp_path / name)


@pytest.mark.slow
def test_compiled_llama_trains_like_eager(tmp_path, caplog):
    """In fp32, held to 1e-4: tighter than bf16's tolerance, and no bf16 rounding to hide a difference in."""
    caplog.set_level(logging.INFO, logger="trainer")
    eager = llama_losses(tmp_path, "eager")
    compiled = llama_losses(tmp_path, "compiled", compile=True)
    assert len(compiled) == len(eager) == 20
    for step, loss in eager.items():
        assert abs(compiled[step] - loss) <= 1e-4 * max(1.0, abs(loss)), (
            f"step {step}: compiled {compiled[step]} vs eager {loss}"
        )
    err = caplog.text
    assert "torch.compile (mode default): 4 unit(s) (TransformerBlock)" in err
    assert "each unit one full graph" in err


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, args",
    [
        (DDP_SCRIPT, ["--trainer-ac", "selective"]),
        (FSDP_SCRIPT, ["--stage", "3", "--ac", "full"]),
    ],
    ids=["ddp+selective", "fsdp3+full"],
)
def test_compile_composes_with_ddp_and_fsdp(tmp_path, script, args):
    args = [*args, "--model", "llama", "--compile", "default"]
    done, root = run_script(2, script, tmp_path, "dist", *args, timeout=300)
    assert "2 unit(s) (CheckpointWrapper)" in done.stderr and "each unit one full graph" in done.stderr
    _, single = single_llama(tmp_path)
    got = read_metrics(root)
    for step, loss in single.items():
        assert abs(got[step] - loss) <= 1e-4, (
            f"step {step}: compiled {script.stem} {args} {got[step]} vs one process {loss}"
        )


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        if h.abs().max() > 0.999:  # data-dependent control flow: the compiler must split the graph here
            h = h * 0.5
        return x + h


class Net(TrainModule):
    """A Lightning-style module with repeated blocks, a logged epoch metric and a scheduler dict."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def transformer_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def net_data(n: int = 64, width: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=g) * 3
    return TensorDataset(x, x.sum(1, keepdim=True).tanh())


def net_losses(tmp_path, name: str, **flags) -> dict[int, float]:
    torch.manual_seed(0)
    fit(Net(), DataLoader(net_data(), batch_size=8), tmp_path / name, 8, enable_checkpointing=False, **flags)
    return read_metrics(tmp_path / name, "train_loss")


@pytest.mark.slow
def test_a_graph_break_is_said_once_and_training_is_unchanged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainer")
    eager = net_losses(tmp_path, "eager")
    compiled = net_losses(tmp_path, "compiled", compile=True)
    for step, loss in eager.items():
        assert abs(compiled[step] - loss) <= 1e-5, f"step {step}: {compiled[step]} vs {loss}"
    err = caplog.text
    assert err.count("Block.forward breaks the graph") == 1, err[-3000:]
    assert "3 unit(s) (Block)" in err and "Block compiled in pieces (graph breaks)" in err


class Regression(TrainModule):
    """No transformer_blocks(): compile takes the module's forward as one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.slow
def test_a_recompile_is_said_once_with_its_reason(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainer")
    g = torch.Generator().manual_seed(0)
    # three batch sizes: the second recompiles (a new shape), the third reuses that dynamic graph
    batches = [(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)) for n in (8, 8, 5, 5, 3, 3)]
    Trainer(
        max_steps=6,
        compile=True,
        enable_progress_bar=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
    ).fit(Regression(), batches)
    err = caplog.text
    assert "1 unit(s) (Regression)" in err
    recompiles = [line for line in err.splitlines() if "torch.compile recompiled forward at step" in line]
    assert len(recompiles) == 1, err[-3000:]
    assert "size mismatch" in recompiles[0], recompiles[0]


def test_bad_compile_values_are_named(tmp_path):
    for bad in ("fast", 1, "True"):
        with pytest.raises(
            ValueError, match=r"compile=.* is invalid; allowed: False, True or a torch.compile mode"
        ):
            Trainer(compile=bad, default_root_dir=tmp_path)


def test_compile_needs_blocks_or_a_forward(tmp_path):
    class StepOnly(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = Trainer(compile=True, max_steps=1, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="StepOnly has neither"):
        trainer.fit(StepOnly(), [(torch.randn(2, 4),)])


def test_dp_sgd_refuses_compile(tmp_path):
    with pytest.raises(ValueError, match="DPSGDStrategy reads each layer's inputs"):
        Trainer(strategy=DPSGDStrategy(noise_multiplier=1.0), compile=True, default_root_dir=tmp_path)


def test_recipe_key_trainer_compile_reaches_the_trainer(tmp_path):
    recipe = load_recipe(RECIPE, ["trainer.compile=max-autotune", f"trainer.default_root_dir={tmp_path}"])
    trainer, *_ = build_run(recipe)
    assert trainer.strategy.compile == "max-autotune"
    with pytest.raises(ConfigError, match="compile='sometimes' is invalid"):
        build_run(load_recipe(RECIPE, ["trainer.compile=sometimes"]))


def test_model_parallel_compile_is_refused_before_any_process_starts(tmp_path):
    with pytest.raises(ValueError, match=r"compile='default' with tp=2: compiled blocks are validated"):
        Trainer(strategy=Parallel3DStrategy(tp=2), devices=2, compile=True, default_root_dir=tmp_path)
