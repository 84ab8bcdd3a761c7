"""Fused optimizer kernels are the default on CUDA when the user's optimizer does not say, and only then;
they change results only in floating-point order (checked with torch's CPU fused kernels here). An SGD over
sharded parameters keeps torch's default: DTensor has no rule for fused SGD."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import Regression, regression_loader
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainer import Trainer
from trainer.core.fused_optim import prefer_fused


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))


def grouped_adamw(net: nn.Module, **kwargs) -> torch.optim.AdamW:
    """nanoGPT's grouping: decay matrices, not norms or biases."""
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, **kwargs)


def train(net: nn.Module, opt: torch.optim.Optimizer, steps: int = 10) -> list[float]:
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(0)
    lrs = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        nn.functional.mse_loss(net(x), x.sum(1, keepdim=True).tanh()).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def test_the_fused_switch_updates_like_torchs_default_and_keeps_the_scheduler():
    plain_net = model()
    fused_net = copy.deepcopy(plain_net)
    plain_opt = grouped_adamw(plain_net)
    fused_opt = grouped_adamw(fused_net)
    sched_before = torch.optim.lr_scheduler.LambdaLR(fused_opt, lambda s: 1.0)  # built before the switch
    assert prefer_fused(fused_opt, device_types=("cpu",)) is fused_opt  # in place: the scheduler drives it
    assert sched_before.optimizer is fused_opt
    assert all(g["fused"] is True for g in fused_opt.param_groups)
    assert train(fused_net, fused_opt) == train(plain_net, plain_opt)  # the same learning rates
    for a, b in zip(fused_net.parameters(), plain_net.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fused_opt.state[next(fused_net.parameters())]["exp_avg"].abs().sum() > 0  # it did step


@pytest.mark.parametrize(
    "make",
    [
        lambda net: grouped_adamw(net, foreach=False),
        lambda net: grouped_adamw(net, fused=False),
        lambda net: torch.optim.Adam(net.parameters(), lr=1e-2, foreach=True),
        lambda net: torch.optim.RMSprop(net.parameters(), lr=1e-2),  # torch has no fused RMSprop
        lambda net: type("MyAdamW", (torch.optim.AdamW,), {})(net.parameters(), lr=1e-2),  # may own step()
    ],
    ids=["foreach=False", "fused=False", "foreach=True", "rmsprop", "subclass"],
)
def test_what_the_user_chose_is_left_alone(make):
    opt = make(model())
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    prefer_fused(opt, device_types=("cpu",))
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups] == before


def test_a_cpu_run_keeps_torchs_default(tmp_path):
    trainer = Trainer(
        accelerator="cpu",  # "auto" would take a GPU where there is one
        max_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Regression(), regression_loader())
    assert [g["fused"] for g in trainer.optimizer.param_groups] == [None]


def test_sgd_over_sharded_parameters_keeps_torchs_default_and_adamw_fuses(tmp_path):
    # DTensor has no sharding rule for fused SGD: fused, FSDP's first SGD step failed (on CUDA)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    net = model()
    fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
    sgd = prefer_fused(torch.optim.SGD(net.parameters(), lr=0.1), device_types=("cpu",))
    adamw = prefer_fused(torch.optim.AdamW(net.parameters(), lr=0.1), device_types=("cpu",))
    assert [g["fused"] for g in sgd.param_groups] == [None]
    assert [g["fused"] for g in adamw.param_groups] == [True]
    net(torch.randn(4, 8)).sum().backward()
    sgd.step()
    adamw.step()  # both step the sharded parameters


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_run_steps_with_fused_kernels(tmp_path):
    trainer = Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=3,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    module = Regression()
    trainer.fit(module, regression_loader())
    assert [g["fused"] for g in trainer.optimizer.param_groups] == [True]
    state = trainer.optimizer.state[next(module.parameters())]
    assert state["step"].device.type == "cuda" and int(state["step"]) == 3
