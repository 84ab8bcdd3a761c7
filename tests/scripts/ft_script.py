"""One replica group (one process) of a fault-tolerant job on torchft, as a user's script runs it:
`python tests/scripts/ft_script.py --lighthouse HOST:PORT --replica-id I --root DIR --out FILE`. It trains the
tests' Regression model with SGD and appends one line per step to ROOT/steps.jsonl (the step, whether it
committed, the participants, the data position, a hash of the parameters). `--kills` schedules this group's
own SIGKILLs, one per attempt (`--attempt`, which the test's relaunch counts): each at a step offset from the
attempt's first step, at the start of the step, during the gradient all-reduce, or after the commit. Both
groups stop `--after-rejoin` steps after the group rejoined for the last time: the survivor knows it by
the other group's drops out of the quorum (the test starts the other group only after the survivor's first
step, so that the survivor sees every one of the `--kills`)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import Regression, regression_loader  # noqa: E402

from callbacks import Callback  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.fault_tolerance import FaultTolerance  # noqa: E402

BATCH, LR, N = 8, 0.05, 256  # the test's reference replay uses the same


def params_hash(module: torch.nn.Module) -> str:
    """The parameters' bytes, hashed: equal hashes are bit-identical parameters."""
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Drill(Callback):
    """Records every step; SIGKILLs this process where `--kills` says; stops after the last rejoin."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        kills = [k.split("@") for k in args.kills.split(",")] if args.kills else []
        mine = args.replica_id == args.killed
        self.kill = kills[args.attempt] if mine and args.attempt < len(kills) else None  # (offset, where)
        self.final = mine and args.attempt >= len(kills)
        self.kills = len(kills)
        self.first_step: int | None = None
        self.seen: list[int] = []  # participants of each step this attempt ran
        self.rejoined_at: int | None = None
        self.position = 0
        self.log = open(Path(args.root) / "steps.jsonl", "a")

    def on_train_batch_start(self, trainer, module, batch_idx):
        replicas = trainer._fit_loop.replicas
        step, n = trainer.global_step, replicas.participants
        if self.first_step is None:
            self.first_step = step
            if self.final:  # the killed group's last attempt: it rejoins now
                self.rejoined_at = step
        drops = sum(1 for a, b in zip(self.seen, self.seen[1:]) if a > b)
        if self.seen and self.seen[-1] < n and drops == self.kills and self.rejoined_at is None:
            self.rejoined_at = step  # the survivor: the killed group is back for the last time
        self.seen.append(n)
        self.position = batch_idx
        time.sleep(self.args.step_sleep)  # a heavier step: fewer solo steps while the other group restarts
        if self.kill is not None and step - self.first_step == int(self.kill[0]):
            where = self.kill[1]
            if where == "start":
                die()
            if where == "allreduce":  # die once this group's part of the gradient all-reduce is under way
                pg, allreduce = replicas.pg, replicas.pg.allreduce

                def allreduce_then_die(*a, **kw):
                    work = allreduce(*a, **kw)
                    die()
                    return work

                pg.allreduce = allreduce_then_die

    def on_train_batch_end(self, trainer, module, outputs):
        row = {
            "step": trainer.global_step - 1,
            "committed": not outputs["skipped"],
            "replicas": trainer._fit_loop.replicas.participants,
            "position": self.position,
            "params": params_hash(module),
            "attempt": self.args.attempt,
        }
        self.log.write(json.dumps(row) + "\n")
        self.log.flush()
        if self.kill is not None and self.kill[1] == "end" and trainer.global_step - 1 - self.first_step == int(self.kill[0]):
            die()
        if self.rejoined_at is not None and trainer.global_step >= self.rejoined_at + self.args.after_rejoin:
            trainer.should_stop = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--killed", type=int, default=1)  # the group --kills applies to
    p.add_argument("--kills", default="")  # "offset@where,..." (where: start, allreduce, end), one per attempt
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--after-rejoin", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--max-steps", type=int, default=100000)  # a bound; the drill stops the groups itself
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    module = Regression(lr=LR, optimizer="sgd")
    Path(args.root).mkdir(parents=True, exist_ok=True)
    drill = Drill(args)
    trainer = Trainer(
        max_steps=args.max_steps,
        seed=args.seed,
        default_root_dir=args.root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[drill],
        fault_tolerance=FaultTolerance(
            lighthouse=args.lighthouse, replica_id=args.replica_id, replicas=2, timeout_s=20, quorum_timeout_s=60
        ),
    )
    trainer.fit(module, regression_loader(batch_size=BATCH, n=N))
    result = {"params": [p.detach().tolist() for p in module.parameters()], "hash": params_hash(module)}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
