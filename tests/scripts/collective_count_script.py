"""Every collective a fit calls from Python, in order, with the micro-batch and optimizer step it falls in:
`python collective_count_script.py --strategy ddp|fsdp --devices 2 --accumulate 3 --model llama ...`
(self-spawning). The fit's clock (`time.time` of trainer.loop.fit_loop and .stopping) is fake: rank r's moves 1 + r seconds
per micro-batch, so `--max-time-s` stops the fit at a step known in advance, decided by rank 1's clock.
With `--skip-at STEP` rank 1's training_step returns None at the first micro-batch of that step (the
module's code says `return None`).
torch.distributed's and the functional collectives (DTensor's) are wrapped before the fit; each call is
recorded with its owner: "fsdp" when FSDP's own code calls it (its parameter all-gathers and gradient
reduce-scatters), else the framework's functions that called it. DDP's gradient all-reduces run in
its C++ reducer and are not seen. Each rank writes its events to ROOT/rank{r}.json (see dist_common)."""

from __future__ import annotations

import functools
import sys
import time
import types
from pathlib import Path

import dist_common
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from dist_common import TIMEOUT_S, parser, train

import trainer.loop.fit_loop
import trainer.loop.stopping
from callbacks import Callback
from strategies import DDPStrategy, FSDPStrategy
from strategies.base import Strategy
from trainer.models.causal_lm import CausalLM

ROOT = str(Path(__file__).parents[2])  # the repository: the framework's files lie under it
# what a collective's name starts with, in torch.distributed and its functional collectives
COLLECTIVE_PREFIXES = ("all_", "reduce", "broadcast", "barrier", "gather", "scatter", "monitored_barrier")
# ["collective", name, owner] | ["micro", batch_idx] | ["step_start", step] | ["step_end", step, skipped] | ["done", stop]
events: list[list] = []
_depth = [0]  # collectives nested in another (all_gather_object's all_gather) count once
clock = types.SimpleNamespace(now=1000.0)


def owner() -> str:
    """'fsdp' if FSDP's own code called the collective, else the framework's callers ('path:function <
    path:function ...', innermost first, at most four)."""
    frame, callers = sys._getframe(2), []
    while frame is not None and len(callers) < 4:
        filename = frame.f_code.co_filename
        if "/torch/distributed/fsdp/" in filename and not callers:
            return "fsdp"
        if filename.startswith(f"{ROOT}/") and "/site-packages/" not in filename:  # a venv may lie inside
            callers.append(f"{filename[len(ROOT) + 1 :]}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(callers) or "unknown"


def counted(name: str, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if _depth[0] == 0:
            events.append(["collective", name, owner()])
        _depth[0] += 1
        try:
            return function(*args, **kwargs)
        finally:
            _depth[0] -= 1

    return wrapper


def wrap_collectives() -> None:
    for module in (dist, funcol):
        for name in dir(module):
            function = getattr(module, name)
            if name.startswith(COLLECTIVE_PREFIXES) and callable(function) and not isinstance(function, type):
                setattr(module, name, counted(f"{module.__name__.rsplit('.', 1)[-1]}.{name}", function))
    forward_step = Strategy.forward_step

    def marked(self, module, batch, batch_idx):
        events.append(["micro", batch_idx])
        clock.now += 1 + self.global_rank
        return forward_step(self, module, batch, batch_idx)

    Strategy.forward_step = marked
    goes_on = trainer.loop.fit_loop.FitLoop._goes_on

    def marked_goes_on(self):  # the stop check between steps (its stop reasons polled)
        go = goes_on(self)
        events.append(["done", not go])
        return go

    trainer.loop.fit_loop.FitLoop._goes_on = marked_goes_on
    fake = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    fake.time = lambda: clock.now
    trainer.loop.fit_loop.time = trainer.loop.stopping.time = fake  # the start, and the polls between steps


class SkipsOnce(CausalLM):
    """CausalLM whose step returns None on rank 1 at the first micro-batch of step `skip_at`."""

    skip_at: int | None = None

    def training_step(self, batch, batch_idx):
        first = batch_idx % self.trainer.accumulate_grad_batches == 0
        if first and self.trainer.global_step == self.skip_at and self.global_rank == 1:
            return None
        return super().training_step(batch, batch_idx)


class StepMarks(Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        events.append(["step_start", trainer.global_step])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        events.append(["step_end", trainer.global_step, outputs["skipped"]])


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    p.add_argument("--max-time-s", type=float, default=3600.0)
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--skip-at", type=int, default=None)
    a = p.parse_args()
    if a.skip_at is not None:
        SkipsOnce.skip_at = a.skip_at
        dist_common.CausalLM = SkipsOnce  # what train() builds for --model llama
    strategy = (DDPStrategy if a.strategy == "ddp" else FSDPStrategy)(timeout_s=TIMEOUT_S)
    wrap_collectives()
    # no checkpoints: their collectives are not per step, and writing them costs the test time
    flags = {"max_time": {"seconds": a.max_time_s}, "log_every_n_steps": a.log_every}
    flags.update(callbacks=[StepMarks()], enable_checkpointing=False)
    train(a, strategy, [], flags=flags, rank_results=lambda: {"events": events})


if __name__ == "__main__":
    main()
