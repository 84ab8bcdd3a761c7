"""A training script the distributed tests run as a user would: `python tests/scripts/dist_script.py ...`
(self-spawning with --devices N) or under torchrun. Rank 0 writes the final parameters to --out."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import (  # noqa: E402
    LLAMA,
    FakeClock,
    Regression,
    TokenMeanLM,
    regression_loader,
    token_loader,
    uneven_token_data,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from callbacks import Callback, ModelCheckpoint, NaNGuard, StragglerDetector, Timer  # noqa: E402
from strategies import DDPStrategy, FSDPStrategy, mesh  # noqa: E402
from trainer import Trainer, integrity, timing  # noqa: E402
from trainer.models.causal_lm import CausalLM  # noqa: E402


class AllReduceCounter(Callback):
    """DDP's gradient all-reduces (one per bucket) in each optimizer step, counted by a comm hook that
    then does DDP's own all-reduce."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._count = 0

    def on_fit_start(self, trainer, module):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting(group, bucket):
            self._count += 1
            return allreduce_hook(group, bucket)

        trainer.strategy.model.register_comm_hook(trainer.strategy.dp_group, counting)

    def on_train_batch_end(self, trainer, module, outputs):
        self.per_step.append(self._count)
        self._count = 0


class ActivationProbe:
    """Measures one forward (the first training step's, on this rank): `saved_bytes`, the distinct
    non-parameter storages that autograd saves for backward as seen by a hook around the whole step
    (a checkpointed block's inner activations go through the checkpoint's own hook instead), and
    `forward_bytes`, the CPU memory the forward allocated and had not freed when it returned."""

    def __init__(self) -> None:
        self.report: dict | None = None

    def measure(self, module: torch.nn.Module, step):
        from torch.profiler import ProfilerActivity, profile

        own = {
            (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
            for p in module.parameters()
        }
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in own:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with (
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            out = step()
        forward = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None)
        self.report = {"saved_bytes": sum(saved.values()), "forward_bytes": forward}
        return out


class ScriptLM(CausalLM):
    """CausalLM with a choice of optimizer (SGD: the update shows every factor on the gradient), whose
    first training step can be measured by an ActivationProbe."""

    def __init__(self, *args, optimizer: str = "adamw", probe: ActivationProbe | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer_name, self.probe = optimizer, probe

    def training_step(self, batch, batch_idx):
        if self.probe is not None and self.probe.report is None:
            return self.probe.measure(self, lambda: super(ScriptLM, self).training_step(batch, batch_idx))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return super().configure_optimizers()


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

    def on_train_batch_end(self, trainer, module, outputs):
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
        if self.grads is None and hasattr(trainer.strategy, "memory_report"):
            self.grads = trainer.strategy.memory_report(module, optimizer).__dict__

    def on_train_batch_end(self, trainer, module, outputs):
        if self.states is None and hasattr(trainer.strategy, "memory_report"):
            self.states = trainer.strategy.memory_report(module, trainer.optimizer).__dict__


class Sleepy(Regression):
    """Regression whose training step sleeps: `step_sleep` on every rank, plus `slow_sleep` on `slow_rank`;
    with a `clock`, the step advances that fake clock instead of sleeping."""

    def __init__(
        self,
        step_sleep: float,
        slow_rank: int,
        slow_sleep: float,
        lr: float = 1e-2,
        optimizer: str = "adamw",
        clock: FakeClock | None = None,
    ) -> None:
        super().__init__(dropout=0.0, lr=lr, optimizer=optimizer)
        self.step_sleep, self.slow_rank, self.slow_sleep = step_sleep, slow_rank, slow_sleep
        self.wait = time.sleep if clock is None else clock.advance

    def training_step(self, batch, batch_idx):
        rank = self.trainer.strategy.global_rank
        self.wait(self.step_sleep + (self.slow_sleep if rank == self.slow_rank else 0.0))
        return super().training_step(batch, batch_idx)


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


class Stragglers(Callback):
    def __init__(self) -> None:
        self.reports: list[dict] = []

    def on_straggler(self, trainer, module, stragglers):
        self.reports.append({"step": trainer.global_step, "ranks": sorted(stragglers)})


class Misbehave(Callback):
    """Raise, hang or die on one rank at one step, to test how the job ends."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_train_batch_end(self, trainer, module, outputs):
        a, rank, step = self.args, trainer.strategy.global_rank, trainer.global_step
        if (rank != a.bad_rank and not a.every_rank) or step != a.bad_step:
            return
        if a.raise_error:
            raise RuntimeError(
                f"deliberate failure on rank {'every' if a.every_rank else rank} at step {step}"
            )
        if a.hang:
            threading.Event().wait()  # for something that never comes
        if a.sigkill and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_after_backward(self, trainer, module):
        """--nan-step k: rank --bad-rank's gradients turn NaN in step k."""
        if (
            trainer.strategy.global_rank == self.args.bad_rank
            and trainer.global_step + 1 == self.args.nan_step
        ):
            next(module.parameters()).grad.fill_(float("nan"))

    def on_train_batch_start(self, trainer, module, batch_idx):
        """--kill-steps a,b: SIGKILL rank --bad-rank before step a in the first attempt, b in the second."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        kills = [int(k) for k in self.args.kill_steps.split(",")] if self.args.kill_steps else []
        if trainer.strategy.global_rank == self.args.bad_rank and attempt < len(kills):
            if trainer.global_step + 1 == kills[attempt]:
                os.kill(os.getpid(), signal.SIGKILL)


def slow_disk(seconds: float) -> None:
    """Rank 1's disk takes `seconds` to finish each checkpoint file it writes."""
    close = integrity.HashingFile.close

    def slow_close(self) -> None:
        if not self.closed and os.environ.get("RANK") == "1":
            time.sleep(seconds)
        close(self)

    integrity.HashingFile.close = slow_close


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", default="auto")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--compression", default=None)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--bad-rank", type=int, default=-1)
    p.add_argument("--bad-step", type=int, default=-1)
    p.add_argument("--raise-error", action="store_true")
    p.add_argument("--every-rank", action="store_true")  # misbehave on every rank, not only --bad-rank
    p.add_argument("--hang", action="store_true")
    p.add_argument("--sigkill", action="store_true")
    p.add_argument("--kill-steps", default="")
    p.add_argument("--bad-save-step", type=int, default=-1)
    p.add_argument("--nan-step", type=int, default=-1)
    p.add_argument("--timer", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-sleep", type=float, default=0.0)
    p.add_argument("--straggler-every", type=int, default=0)
    p.add_argument("--fake-clock", action="store_true")  # phase times: step sleeps move a fake clock
    p.add_argument("--start-delay", type=float, default=0.0)  # seconds rank 1 takes to start
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--replicate", type=int, default=1)
    p.add_argument("--ac", default=None)
    p.add_argument("--trainer-ac", default=None)  # the Trainer's activation_checkpointing flag
    p.add_argument("--compile", default=None)  # the Trainer's compile flag: a mode ("default", ...)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--precision", default="32")
    p.add_argument("--model", default="regression", choices=["regression", "llama", "tokens"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])  # "tokens" always uses SGD
    p.add_argument("--lr", type=float, default=None)  # None: the model's own default
    p.add_argument("--no-clip", action="store_true")  # gradient_clip_val=None instead of 0.5
    p.add_argument("--report-activations", action="store_true")  # bytes the first forward keeps for backward
    p.add_argument("--report-placement", action="store_true")  # FSDP offload policies and tensor devices
    p.add_argument("--validate", action="store_true")
    p.add_argument("--count-allreduces", action="store_true")  # DDP's gradient all-reduces per step
    p.add_argument(
        "--slow-disk", type=float, default=0.0
    )  # seconds rank 1 takes to close each checkpoint file
    p.add_argument("--io-floor", type=float, default=None)  # the disk rate (bytes/s) checkpoint waits assume
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    if os.environ.get("RANK") == "1":
        time.sleep(a.start_delay)  # a slow start (imports, data): no collective, whatever timeout_s is
    clock = FakeClock() if a.fake_clock else None
    if clock is not None:
        timing.perf_counter = clock
    if a.io_floor is not None:
        mesh.IO_FLOOR_BYTES_PER_S = a.io_floor
    if a.slow_disk:
        slow_disk(a.slow_disk)
    devices = a.devices if a.devices == "auto" else int(a.devices)
    processes = (os.cpu_count() if devices == "auto" else devices) * a.num_nodes
    world = int(os.environ.get("WORLD_SIZE", processes if devices != "auto" else 1))
    micro = a.global_batch // (world * a.accumulate)
    if a.strategy == "fsdp":
        strategy = (BadSave if a.bad_save_step >= 0 else FSDPStrategy)(
            **({"bad_step": a.bad_save_step} if a.bad_save_step >= 0 else {}),
            zero_stage=a.stage,
            replicate=a.replicate,
            activation_checkpointing=a.ac,
            cpu_offload=a.offload,
            async_save=a.async_save,
            timeout_s=a.timeout,
        )
    else:
        strategy = DDPStrategy(gradient_compression=a.compression, powersgd_start_iter=2, timeout_s=a.timeout)
    probe, stragglers = MemoryProbe(), Stragglers()
    activations, placement = ActivationProbe() if a.report_activations else None, PlacementProbe()
    extra = [Timer()] if a.timer else []
    if a.report_placement:
        extra.append(placement)
    allreduces = AllReduceCounter()
    if a.count_allreduces:
        extra.append(allreduces)
    guard = NaNGuard(rollback_after=None)
    if a.nan_step >= 0:
        extra.append(guard)
    if a.straggler_every:
        extra += [StragglerDetector(every_n_steps=a.straggler_every, window=a.straggler_every), stragglers]
    trainer = Trainer(
        strategy=strategy,
        devices=devices,
        num_nodes=a.num_nodes,
        max_steps=a.steps,
        precision=a.precision,
        compile=a.compile or False,
        activation_checkpointing=a.trainer_ac,
        accumulate_grad_batches=a.accumulate,
        gradient_clip_val=None if a.no_clip else 0.5,
        seed=0,
        log_every_n_steps=1,
        enable_progress_bar=False,
        default_root_dir=a.root,
        callbacks=[
            Misbehave(a),
            probe,
            *extra,
            ModelCheckpoint(every_n_steps=a.ckpt_every, save_top_k=a.top_k),
        ],
    )
    lr = {} if a.lr is None else {"lr": a.lr}
    if a.model == "llama":
        lr = {"lr": 1e-2, **lr}
        if a.optimizer == "adamw" and activations is None:
            module = CausalLM(LLAMA, **lr)
        else:
            module = ScriptLM(LLAMA, optimizer=a.optimizer, probe=activations, **lr)
        loader = token_loader(micro)
    elif a.model == "tokens":
        module, loader = TokenMeanLM(**lr), DataLoader(uneven_token_data(by_parity=True), batch_size=micro)
    else:
        module = Sleepy(a.step_sleep, a.slow_rank, a.slow_sleep, optimizer=a.optimizer, clock=clock, **lr)
        loader = regression_loader(batch_size=micro, shuffle=a.shuffle)
    val_loader = None
    if a.validate:
        val_loader = token_loader(micro) if a.model == "llama" else regression_loader(batch_size=micro)
    trainer.fit(module, loader, val_loader, ckpt_path="last" if a.resume else None)
    params = [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().tolist()
        for p in module.parameters()
    ]
    rank = trainer.strategy.global_rank
    Path(a.root, f"rank{rank}.json").write_text(
        json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "params": params, "skipped": guard.skipped})
    )
    if trainer.is_global_zero:
        Path(a.out).write_text(
            json.dumps(
                {
                    "world_size": trainer.strategy.world_size,
                    "global_step": trainer.global_step,
                    "stragglers": stragglers.reports,
                    "params": params,
                    "memory": {"grads": probe.grads, "states": probe.states},
                    "activations": activations.report if activations is not None else None,
                    "placement": placement.report,
                    "allreduces": allreduces.per_step,
                }
            )
        )


if __name__ == "__main__":
    main()
