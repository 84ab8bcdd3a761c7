"""A user's fault-tolerant training script as `trainer replicas` runs it (one process per replica group here):
`trainer replicas --groups 2 --max-restarts 1 tests/scripts/ft_launch_script.py --root DIR`. The
group reads who it is from the launcher's environment (`FaultTolerance.from_env`), trains the tests' Regression
model with SGD in DIR/replica{I} with a ModelCheckpoint every `--every` steps, and appends one line per step to
DIR/replica{I}/steps.jsonl: the step, whether it committed, the participants, a hash of the parameters, this
process's pid and torchrun's restart count. It trains `--steps` steps, or until DIR/stop exists. When DIR/hold
names a step, the group stops at that step's end: once its checkpoint is complete, it writes
DIR/replica{I}/held and waits while DIR/hold exists and no SIGTERM came (the test's way to kill the whole job at a known
checkpoint: every group holds at the same step)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/scripts: ft_script's hash
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from ft_script import BATCH, LR, N, params_hash  # noqa: E402
from helpers import Regression, regression_loader  # noqa: E402

from callbacks import Callback, ModelCheckpoint  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.checkpoint import find_last  # noqa: E402
from trainer.fault_tolerance import FaultTolerance  # noqa: E402


class StepLog(Callback):
    """One line per step in `path`; stops the fit once ROOT/stop exists or after `steps` steps of this run;
    holds at the checkpoint of the step ROOT/hold names."""

    def __init__(self, path: Path, root: Path, args: argparse.Namespace) -> None:
        self.path, self.root, self.args = path, root, args
        self.first: int | None = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.first = trainer.global_step if self.first is None else self.first
        time.sleep(self.args.step_sleep)  # a heavier step: the test's signals land mid-run, not after it

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        row = {
            "step": trainer.global_step - 1,
            "committed": not outputs["skipped"],
            "replicas": trainer._fit_loop.replicas.participants,
            "params": params_hash(module),
            "pid": os.getpid(),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "first": self.first,
        }
        with open(self.path, "a") as log:
            log.write(json.dumps(row) + "\n")
        hold = self.root / "hold"
        if hold.exists() and hold.read_text() == str(trainer.global_step):
            self.hold(trainer)
        if (self.root / "stop").exists() or trainer.global_step - self.first >= self.args.steps:
            trainer.should_stop = True

    def hold(self, trainer) -> None:
        """Wait here (this step's checkpoint complete, DIR/replica{I}/held written) while DIR/hold exists and
        no stop signal came (SIGTERM: the fit then stops as after any step, not after torchrun's 30 s grace)."""
        folder = self.path.parent
        held = folder / "held"
        while (self.root / "hold").exists() and trainer._fit_loop.signals.received is None:
            last = find_last(trainer.checkpoint_dir)
            if last is not None and last.name == f"step-{trainer.global_step:08d}" and not held.exists():
                (folder / "held.tmp").write_text(str(trainer.global_step))
                (folder / "held.tmp").rename(
                    held
                )  # whole when the test reads it (rewritten in place, it read '')
            time.sleep(0.02)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", required=True)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--timeout-s", type=float, default=4.0)
    p.add_argument("--older", type=int, help="this group resumes from the checkpoint before its newest")
    args = p.parse_args()
    torch.set_num_threads(1)
    ft = FaultTolerance.from_env(timeout_s=args.timeout_s, quorum_timeout_s=60)
    folder = Path(args.root) / f"replica{ft.replica_id}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    trainer = Trainer(
        max_steps=100000,
        seed=0,
        default_root_dir=folder,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(every_n_steps=args.every, save_top_k=-1, validate=False),
            StepLog(folder / "steps.jsonl", Path(args.root), args),
        ],
        fault_tolerance=ft,
    )
    trainer.fit(
        Regression(lr=LR, optimizer="sgd"),
        regression_loader(batch_size=BATCH, n=N),
        # resume or start: a restarted group (torchrun) or a relaunched job continues from this group's newest
        # checkpoint in its own run folder, then the quorum brings it to the live step
        ckpt_path=older(folder) if args.older == ft.replica_id else "last",
    )


def older(folder: Path) -> str:
    """The checkpoint before this group's newest (a group whose newest save was lost)."""
    return str(sorted((folder / "checkpoints").glob("step-*"))[-2])


if __name__ == "__main__":
    main()
