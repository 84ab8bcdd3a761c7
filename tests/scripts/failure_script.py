"""How a DDP job ends or recovers when a rank fails, as a user's script would see it: one rank (or every
rank) raises, hangs, is SIGKILLed (also by step in each torchrun attempt: --kill-steps), turns its gradients
NaN, starts late or writes checkpoints to a slow disk. `python tests/scripts/failure_script.py --devices N
...` (self-spawning) or under torchrun; rank 0 writes the final parameters to --out (see dist_common)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

from dist_common import parser, train

from callbacks import Callback, NaNGuard
from strategies import DDPStrategy, mesh
from trainer.checkpoint import integrity


class Misbehave(Callback):
    """Raise, hang or die on one rank at one step, to test how the job ends."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
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

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        """--kill-steps a,b: SIGKILL rank --bad-rank before step a in the first attempt, b in the second."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        kills = [int(k) for k in self.args.kill_steps.split(",")] if self.args.kill_steps else []
        if trainer.strategy.global_rank == self.args.bad_rank and attempt < len(kills):
            if trainer.global_step + 1 == kills[attempt]:
                os.kill(os.getpid(), signal.SIGKILL)


def slow_disk(seconds: float) -> None:
    """Rank 1's disk takes `seconds` to finish the first checkpoint file it writes: every later file of that
    save waits behind it, so the save as a whole takes longer than `seconds` (one slow file is the case; a
    sleep on each file only made the test longer)."""
    close = integrity.HashingFile.close
    first = os.environ.get("RANK") == "1"

    def slow_close(self) -> None:
        nonlocal first
        if not self.closed and first:
            first = False
            time.sleep(seconds)
        close(self)

    integrity.HashingFile.close = slow_close


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=600.0)  # DDPStrategy(timeout_s=...): the collectives'
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--bad-rank", type=int, default=-1)
    p.add_argument("--bad-step", type=int, default=-1)
    p.add_argument("--raise-error", action="store_true")
    p.add_argument("--every-rank", action="store_true")  # misbehave on every rank, not only --bad-rank
    p.add_argument("--hang", action="store_true")
    p.add_argument("--sigkill", action="store_true")
    p.add_argument("--kill-steps", default="")
    p.add_argument("--nan-step", type=int, default=-1)
    p.add_argument("--start-delay", type=float, default=0.0)  # seconds rank 1 takes to start
    p.add_argument(
        "--slow-disk", type=float, default=0.0
    )  # seconds rank 1 takes to close each checkpoint file
    p.add_argument("--io-floor", type=float, default=None)  # the disk rate (bytes/s) checkpoint waits assume
    a = p.parse_args()
    if os.environ.get("RANK") == "1":
        time.sleep(a.start_delay)  # a slow start (imports, data): no collective, whatever timeout_s is
    if a.io_floor is not None:
        mesh.IO_FLOOR_BYTES_PER_S = a.io_floor
    if a.slow_disk:
        slow_disk(a.slow_disk)
    strategy = DDPStrategy(powersgd_start_iter=2, timeout_s=a.timeout)
    guard = NaNGuard(rollback_after=None)
    train(
        a,
        strategy,
        [Misbehave(a), *([guard] if a.nan_step >= 0 else [])],
        shuffle=a.shuffle,
        rank_results=lambda: {"skipped": guard.skipped},
    )


if __name__ == "__main__":
    main()
