"""A DDP job's clocks, as a user's script would see them: a Timer that a SIGTERM (to rank 0 or to torchrun)
stops with a checkpoint, and straggler detection of a rank whose steps are slower (--slow-rank), timed by a
fake clock that only the steps' sleeps move (--fake-clock). `python tests/scripts/timing_script.py --devices
N ...` (self-spawning) or under torchrun; rank 0 writes the final step and parameters to --out."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from dist_common import TIMEOUT_S, parser, train  # noqa: E402
from helpers import FakeClock, Regression  # noqa: E402

from callbacks import Callback, StragglerDetector, Timer  # noqa: E402
from strategies import DDPStrategy  # noqa: E402
from trainer.core import timing  # noqa: E402


class Sleepy(Regression):
    """Regression whose training step sleeps: `step_sleep` on every rank, plus `slow_sleep` on `slow_rank`;
    with a `clock`, the step advances that fake clock instead of sleeping."""

    def __init__(
        self,
        step_sleep: float,
        slow_rank: int,
        slow_sleep: float,
        optimizer: str = "adamw",
        clock: FakeClock | None = None,
    ) -> None:
        super().__init__(dropout=0.0, optimizer=optimizer)
        self.step_sleep, self.slow_rank, self.slow_sleep = step_sleep, slow_rank, slow_sleep
        self.wait = time.sleep if clock is None else clock.advance

    signal_at: tuple[int, int, int] | None = None  # (rank, step, signal): that rank's own Ctrl-C or SIGTERM

    def training_step(self, batch, batch_idx):
        rank = self.trainer.strategy.global_rank
        self.wait(self.step_sleep + (self.slow_sleep if rank == self.slow_rank else 0.0))
        if self.signal_at is not None and self.signal_at[:2] == (rank, self.trainer.global_step + 1):
            os.kill(os.getpid(), self.signal_at[2])  # inside the step, as a user's Ctrl-C lands
        return super().training_step(batch, batch_idx)


class Stragglers(Callback):
    """The steps and ranks of every `on_straggler` call."""

    def __init__(self) -> None:
        self.reports: list[dict] = []

    def on_straggler(self, trainer, module, stragglers):
        self.reports.append({"step": trainer.global_step, "ranks": sorted(stragglers)})


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--timer", action="store_true")  # a Timer: SIGTERM stops the fit with a checkpoint
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-sleep", type=float, default=0.0)
    p.add_argument("--straggler-every", type=int, default=0)
    p.add_argument("--fake-clock", action="store_true")  # phase times: step sleeps move a fake clock
    p.add_argument("--signal-at", default=None)  # RANK:STEP:SIGNAME, e.g. 1:3:SIGINT
    a = p.parse_args()
    if a.signal_at:
        rank, step, name = a.signal_at.split(":")
        Sleepy.signal_at = (int(rank), int(step), getattr(signal, name))
    clock = FakeClock() if a.fake_clock else None
    if clock is not None:
        timing.perf_counter = clock
    stragglers = Stragglers()
    callbacks = [Timer()] if a.timer else []
    if a.straggler_every:
        callbacks += [
            StragglerDetector(every_n_steps=a.straggler_every, window=a.straggler_every),
            stragglers,
        ]
    train(
        a,
        DDPStrategy(powersgd_start_iter=2, timeout_s=TIMEOUT_S),
        callbacks,
        regression=lambda: Sleepy(
            a.step_sleep, a.slow_rank, a.slow_sleep, optimizer=a.optimizer, clock=clock
        ),
        shuffle=a.shuffle,
        results=lambda: {"stragglers": stragglers.reports},
    )


if __name__ == "__main__":
    main()
