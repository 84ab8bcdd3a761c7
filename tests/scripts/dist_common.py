"""What the distributed training scripts (ddp_, fsdp_, failure_ and timing_script.py) share: the flags of
the run they train, the modules they train, one fit, and the results rank 0 writes to --out and every rank to
ROOT/rank{r}.json. A script adds only the flags and callbacks of what it probes."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import LLAMA, Regression, TokenMeanLM, regression_loader, token_loader, uneven_token_data  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from callbacks import Callback, ModelCheckpoint  # noqa: E402
from strategies import Strategy  # noqa: E402
from trainer import Trainer, TrainModule  # noqa: E402
from trainer.core.dtensors import full_value, local_part  # noqa: E402
from trainer.models.causal_lm import CausalLM  # noqa: E402

TIMEOUT_S = 600.0  # the collective timeout of a run that does not probe timeouts (failure_script's --timeout)


def parser(description: str) -> argparse.ArgumentParser:
    """The flags of the run itself: processes, steps and batch, checkpoints, model and optimizer, Trainer
    flags every strategy takes, and where the results go."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--devices", default="auto")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--validate", action="store_true")
    p.add_argument("--model", default="regression", choices=["regression", "llama", "tokens"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "sgd-steplr"])  # "tokens": SGD
    p.add_argument("--no-clip", action="store_true")  # gradient_clip_val=None instead of 0.5
    p.add_argument("--precision", default="32")
    p.add_argument("--compile", default=None)  # the Trainer's compile flag: a mode ("default", ...)
    p.add_argument("--report-activations", action="store_true")  # bytes the first forward keeps for backward
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    return p


def parse_runs(p: argparse.ArgumentParser) -> list[argparse.Namespace]:
    """The runs this launch trains, in order: the command line's one, or with `--runs JSON` (a list of
    argument lists, each naming its own --root and --out; the rest of the command line is common to all) each
    in turn in the same torchrun world: one launch pays the processes' start-up for many cases."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--runs", default=None)
    known, common = pre.parse_known_args()
    if known.runs is None:
        return [p.parse_args()]
    return [p.parse_args([*common, *run]) for run in json.loads(known.runs)]


class ActivationProbe:
    """Measures one forward (the first training step's, on this rank): `saved_bytes`, the distinct
    non-parameter storages that autograd saves for backward as seen by a hook around the whole step
    (a checkpointed block's inner activations go through the checkpoint's own hook instead), and
    `forward_bytes`, the CPU memory the forward allocated and had not freed when it returned."""

    def __init__(self) -> None:
        self.report: dict | None = None

    def measure(self, module: torch.nn.Module, step):
        from torch.profiler import ProfilerActivity, profile

        own = {local_part(p).untyped_storage().data_ptr() for p in module.parameters()}
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


def train(
    a: argparse.Namespace,
    strategy: Strategy,
    callbacks: list[Callback],
    *,
    num_nodes: int = 1,
    activation_checkpointing: str | None = None,
    regression: Callable[[], TrainModule] | None = None,
    shuffle: bool = False,
    results: Callable[[], dict] = dict,
    rank_results: Callable[[], dict] = dict,
    flags: dict | None = None,
) -> None:
    """Fit `a.model` under `strategy` with `callbacks` (then a ModelCheckpoint) and write the results:
    `regression` builds the regression model (default: helpers.Regression), `results()` and
    `rank_results()` add the script's own fields to rank 0's --out and to each rank's file; `flags` are
    Trainer flags of the script's own (they replace these defaults)."""
    torch.set_num_threads(1)
    devices = a.devices if a.devices == "auto" else int(a.devices)
    processes = (os.cpu_count() if devices == "auto" else devices) * num_nodes
    world = int(os.environ.get("WORLD_SIZE", processes if devices != "auto" else 1))
    micro = a.global_batch // (world * a.accumulate)
    activations = ActivationProbe() if a.report_activations else None
    trainer_flags = dict(
        strategy=strategy,
        devices=devices,
        num_nodes=num_nodes,
        max_steps=a.steps,
        precision=a.precision,
        compile=a.compile or False,
        activation_checkpointing=activation_checkpointing,
        accumulate_grad_batches=a.accumulate,
        gradient_clip_val=None if a.no_clip else 0.5,
        seed=0,
        log_every_n_steps=1,
        enable_progress_bar=False,
        default_root_dir=a.root,
        callbacks=[*callbacks, ModelCheckpoint(every_n_steps=a.ckpt_every, save_top_k=2)],
    ) | (flags or {})
    trainer = Trainer(**trainer_flags)
    # the module is built right after the Trainer's seed_everything(0): the tests' references rely on it
    if a.model == "llama":
        if a.optimizer == "adamw" and activations is None:
            module = CausalLM(LLAMA, lr=1e-2)
        else:
            module = ScriptLM(LLAMA, optimizer=a.optimizer, probe=activations, lr=1e-2)
        loader = token_loader(micro)
    elif a.model == "tokens":
        module, loader = TokenMeanLM(), DataLoader(uneven_token_data(by_parity=True), batch_size=micro)
    else:
        module = regression() if regression else Regression(dropout=0.0, optimizer=a.optimizer)
        loader = regression_loader(batch_size=micro, shuffle=shuffle)
    val_loader = None
    if a.validate:
        val_loader = token_loader(micro) if a.model == "llama" else regression_loader(batch_size=micro)
    trainer.fit(module, loader, val_loader, ckpt_path="last" if a.resume else None)
    params = [full_value(p).detach().flatten().tolist() for p in module.parameters()]
    rank = trainer.strategy.global_rank
    Path(a.root, f"rank{rank}.json").write_text(
        json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "params": params, **rank_results()})
    )
    if trainer.is_global_zero:
        report = {"world_size": trainer.strategy.world_size, "global_step": trainer.global_step}
        report.update(params=params, activations=activations.report if activations else None, **results())
        Path(a.out).write_text(json.dumps(report))
