"""FSDP/ZeRO as a user's script sets it: `python tests/scripts/fsdp_script.py --devices N --stage S ...`
(self-spawning), with its memory features (--ac, --offload, --replicate), async checkpoints and a
checkpoint whose saved weights are wrong (--bad-save-step). Rank 0 writes the final parameters, the
strategy's memory report and, on request, where FSDP placed each tensor (--report-placement) to --out."""

from __future__ import annotations

import argparse

import torch
from dist_common import TIMEOUT_S, parse_runs, parser, train
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

from callbacks import Callback
from strategies import FSDPStrategy


class PlacementProbe(Callback):
    """Where FSDP put things on this rank: each fully_shard-ed module's offload policy, and the devices of
    parameter shards, gradients (before the first optimizer step) and optimizer states (after it)."""

    def __init__(self) -> None:
        self.report: dict = {}

    @staticmethod
    def _devices(tensors) -> list[str]:
        return sorted({str((t.to_local() if isinstance(t, DTensor) else t).device) for t in tensors})

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if "grad_devices" in self.report:
            return
        sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
        groups = [m._get_fsdp_state()._fsdp_param_group for m in sharded]
        self.report.update(
            sharded_modules=len(sharded),
            cpu_offload_policies=sum(
                isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups if g is not None
            ),
            offloaded_params=sum(fp.offload_to_cpu for g in groups if g is not None for fp in g.fsdp_params),
            fsdp_params=sum(len(g.fsdp_params) for g in groups if g is not None),
            dtensor_params=sum(isinstance(p, DTensor) for p in module.parameters()),
            params=sum(1 for _ in module.parameters()),
            param_devices=self._devices(module.parameters()),
            grad_devices=self._devices(p.grad for p in module.parameters() if p.grad is not None),
        )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if "state_devices" not in self.report:
            states = trainer.optimizer.state.values()
            self.report["state_devices"] = self._devices(
                v for state in states for v in state.values() if isinstance(v, torch.Tensor) and v.dim()
            )


class MemoryProbe(Callback):
    """Records the strategy's per-rank memory report with gradients present and after the first step."""

    def __init__(self) -> None:
        self.grads = self.states = None

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if self.grads is None:
            self.grads = trainer.strategy.memory_report(module, optimizer).__dict__

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.states is None:
            self.states = trainer.strategy.memory_report(module, trainer.optimizer).__dict__


class BadSave(FSDPStrategy):
    """Shifts this rank's shard of the first parameter while one step's checkpoint is written: the files
    and their checksums agree, the weights are wrong. Only reloading the checkpoint can tell."""

    def __init__(self, bad_step: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bad_step = bad_step

    def save_checkpoint(self, path, module, optimizer, state):
        if state["loop"]["global_step"] != self.bad_step:
            return super().save_checkpoint(path, module, optimizer, state)
        self.reshard(module)  # stage 2 keeps parameters gathered after the reference forward
        local = next(module.parameters()).to_local()
        with torch.no_grad():
            local.add_(0.5)
        try:
            super().save_checkpoint(path, module, optimizer, state)
        finally:
            with torch.no_grad():
                local.sub_(0.5)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--replicate", type=int, default=1)
    p.add_argument("--ac", default=None)  # FSDPStrategy(activation_checkpointing=...)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--bad-save-step", type=int, default=-1)  # this step's checkpoint holds wrong weights
    p.add_argument("--report-placement", action="store_true")  # FSDP offload policies and tensor devices
    for a in parse_runs(p):
        fit(a)


def fit(a: argparse.Namespace) -> None:
    """One run of this script: the strategy its flags describe, trained and reported (dist_common.train)."""
    kwargs = dict(
        zero_stage=a.stage,
        replicate=a.replicate,
        activation_checkpointing=a.ac,
        cpu_offload=a.offload,
        async_save=a.async_save,
        timeout_s=TIMEOUT_S,
    )
    strategy = BadSave(a.bad_save_step, **kwargs) if a.bad_save_step >= 0 else FSDPStrategy(**kwargs)
    memory, placement = MemoryProbe(), PlacementProbe()
    train(
        a,
        strategy,
        [memory, *([placement] if a.report_placement else [])],
        results=lambda: {
            "memory": {"grads": memory.grads, "states": memory.states},
            "placement": placement.report,
        },
    )


if __name__ == "__main__":
    main()
