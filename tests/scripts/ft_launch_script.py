"""A user's fault-tolerant training script as `trainer replicas` runs it (one process per replica group here):
`trainer replicas --groups 2 --max-restarts 1 tests/scripts/ft_launch_script.py --root DIR [--resume]`. The
group reads who it is from the launcher's environment (`FaultTolerance.from_env`), trains the tests' Regression
model with SGD in DIR/replica{I} with a ModelCheckpoint every `--every` steps, and appends one line per step to
DIR/replica{I}/steps.jsonl: the step, whether it committed, the participants, a hash of the parameters, this
process's pid and torchrun's restart count. It trains until DIR/stop exists, or `--steps` more steps."""

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
from trainer.fault_tolerance import FaultTolerance  # noqa: E402


class StepLog(Callback):
    """One line per step in `path`; stops the fit once `stop` exists or after `steps` steps of this run."""

    def __init__(self, path: Path, stop: Path, steps: int, step_sleep: float) -> None:
        self.path, self.stop, self.steps, self.step_sleep = path, stop, steps, step_sleep
        self.first: int | None = None

    def on_train_batch_start(self, trainer, module, batch_idx):
        self.first = trainer.global_step if self.first is None else self.first
        time.sleep(self.step_sleep)  # a heavier step: the test's signals land mid-run, not after it

    def on_train_batch_end(self, trainer, module, outputs):
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
        if self.stop.exists() or trainer.global_step - self.first >= self.steps:
            trainer.should_stop = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", required=True)
    p.add_argument("--resume", action="store_true")  # fit(ckpt_path="last"): this group's last checkpoint
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--timeout-s", type=float, default=4.0)
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
            StepLog(folder / "steps.jsonl", Path(args.root) / "stop", args.steps, args.step_sleep),
        ],
        fault_tolerance=ft,
    )
    trainer.fit(
        Regression(lr=LR, optimizer="sgd"),
        regression_loader(batch_size=BATCH, n=N),
        ckpt_path="last" if args.resume else None,
    )


if __name__ == "__main__":
    main()
