"""One replica group (one process) of a fault-tolerant job on torchft, as a user's script runs it:
`python tests/scripts/ft_script.py --lighthouse HOST:PORT --replica-id I --root DIR --out FILE`. It trains the
tests' Regression model with SGD and appends one line per step to ROOT/steps-rank0.jsonl (the step, whether it
committed, the participants, the data position, a hash of the parameters; ROOT/steps-rank{r}.jsonl per rank
with `--group-strategy fsdp|ddp`, where the group is a torchrun job of FSDP or DDP ranks). `--kills` schedules this group's
own SIGKILLs, one per attempt (`--restarts K` relaunches it up to K times, see `relaunch`): each at a step offset from the
attempt's first step, at the start of the step, during the gradient all-reduce, or after the commit
(`--skip-at`: that group skips its update at a step offset instead, alive; `--save-at` saves a checkpoint
after a step, `--resume` starts the fit from one). Both
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
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import Regression, regression_loader  # noqa: E402

from callbacks import Callback  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.fault_tolerance import FaultTolerance  # noqa: E402

BATCH, LR, N = 8, 0.05, 256  # the test's reference replay uses the same


def params_hash(module: torch.nn.Module) -> str:
    """The parameters' bytes (this rank's shards of sharded ones), hashed: equal hashes are bit-identical."""
    digest = hashlib.sha256()
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        digest.update(local.detach().cpu().contiguous().numpy().tobytes())
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
        self.skip_at = args.skip_at if mine else None  # an offset from the first step
        self.final = mine and args.attempt >= len(kills)
        self.kills = len(kills)
        self.first_step: int | None = None
        self.seen: list[int] = []  # participants of each step this attempt ran
        self.rejoined_at: int | None = None
        self.position = 0
        self.log = None  # ROOT/steps-rank{r}.jsonl, opened at the first step (the rank is known then)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        # the step's quorum is not read here: it forms during the forward and is joined before the backward
        # (a group that recovers then runs the step again, this hook included, from the peer's position)
        self.position = batch_idx
        time.sleep(self.args.step_sleep)  # a heavier step: fewer solo steps while the other group restarts
        if self.first_step is None or self.kill is None or not self.kills_me(trainer):
            return
        if trainer.global_step - self.first_step == int(self.kill[0]):
            where = self.kill[1]
            if where == "start":
                die()
            if where == "allreduce":  # die in place of this group's part of the gradient all-reduce: the
                # survivor is in (or enters) its all-reduce with a dead peer
                trainer._fit_loop.replicas.pg.allreduce = lambda *a, **kw: die()

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if self.skip_at is not None and self.first_step is not None:
            if trainer.global_step - self.first_step == self.skip_at:
                trainer.skip_optimizer_step("the drill skips this step in this group only")

    def record_participants(self, step: int, n: int) -> None:
        """The first step this attempt ran; whether the other group is back for the last time."""
        if self.first_step is None:
            self.first_step = step
            if self.final:  # the killed group's last attempt: it rejoins now
                self.rejoined_at = step
        drops = sum(1 for a, b in zip(self.seen[:-1], self.seen[1:], strict=True) if a > b)
        if self.seen and self.seen[-1] < n and drops == self.kills and self.rejoined_at is None:
            self.rejoined_at = step  # the survivor: the killed group is back for the last time
        self.seen.append(n)

    def kills_me(self, trainer) -> bool:
        """Only rank --kill-rank of the group dies (under torchrun its agent then restarts the whole group)."""
        return trainer.global_rank == self.args.kill_rank

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.log is None:
            self.log = open(Path(self.args.root) / f"steps-rank{trainer.global_rank}.jsonl", "a")
        n = trainer._fit_loop.replicas.participants
        self.record_participants(trainer.global_step - 1, n)
        row = {
            "step": trainer.global_step - 1,
            "committed": not outputs["skipped"],
            "replicas": n,
            "position": self.position,
            "params": params_hash(module),
            "attempt": self.args.attempt,
            "synced": trainer._fit_loop.replicas.synced,
            "quorum": (trainer._fit_loop.replicas._joined_at or (None,))[0] == trainer.global_step - 1,
        }
        self.log.write(json.dumps(row) + "\n")
        self.log.flush()
        if (
            self.kill is not None
            and self.kill[1] == "end"
            and trainer.global_step - 1 - self.first_step == int(self.kill[0])
        ):
            die()
        if self.rejoined_at is not None and trainer.global_step >= self.rejoined_at + self.args.after_rejoin:
            trainer.should_stop = True
        if trainer.global_step == self.args.save_at:
            trainer.save_checkpoint(Path(self.args.root) / "checkpoint")


def train(args: argparse.Namespace) -> None:
    """One attempt of this group: a fit until the drill stops it (or it is killed)."""
    torch.manual_seed(args.seed)
    module = Regression(lr=LR, optimizer=args.optimizer)
    trainer = Trainer(
        strategy=args.group_strategy or "auto",
        max_steps=args.max_steps,
        seed=args.seed,
        default_root_dir=args.root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[Drill(args)],
        fault_tolerance=FaultTolerance(
            lighthouse=args.lighthouse,
            replica_id=args.replica_id,
            replicas=2,
            timeout_s=20,
            quorum_timeout_s=args.quorum_timeout,
            sync_every=args.sync_every,
            sync_optimizer_state=args.sync_optimizer_state,
            sync_warmup_steps=args.sync_warmup_steps,
            sync_combined_second_moment=args.sync_combined_second_moment,
            quorum_every=args.quorum_every,
            max_quorum_interval_s=args.max_quorum_interval,
        ),
    )
    trainer.fit(module, regression_loader(batch_size=BATCH, n=N), ckpt_path=args.resume)
    if trainer.is_global_zero and not args.group_strategy:
        result = {"params": [p.detach().tolist() for p in module.parameters()], "hash": params_hash(module)}
        Path(args.out).write_text(json.dumps(result))


def relaunch(args: argparse.Namespace) -> None:
    """Run attempt after attempt, each a fresh process forked from this one (which only imported), until one
    ends by itself; each attempt's exit status goes to ROOT/attempts.json. A restart that costs a fork
    instead of Python's and torch's start-up, so that the test can afford many. The first attempt starts
    once the survivor (whose step log is `--wait-for`) took a step; each next one once the survivor
    committed a step alone after this group's last one: every outage is seen by the survivor."""
    statuses: list[int] = []
    for attempt in range(args.restarts + 1):
        wait_for_the_survivor(args, attempt)
        pid = os.fork()
        if pid == 0:
            args.attempt, code = attempt, 1
            try:
                train(args)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)  # the child never returns into the relaunch loop
        statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        (Path(args.root) / "attempts.json").write_text(json.dumps(statuses))
        if statuses[-1] != -signal.SIGKILL:
            break
    raise SystemExit(0 if statuses[-1] == 0 else 1)


def wait_for_the_survivor(args: argparse.Namespace, attempt: int) -> None:
    """Until the survivor (whose step log is `--wait-for`) took a step, or for a later attempt, committed a
    step alone after this group's last one: every outage is seen by the survivor, however fast the restart
    (torchrun restarts at once, and a fork of the tests' preloaded interpreter starts in a few ms)."""
    if attempt == 0:
        wait_for_row(Path(args.wait_for), lambda row: True)
        return
    mine = Path(args.root) / "steps-rank0.jsonl"
    last = max(json.loads(line)["step"] for line in mine.read_text().splitlines() if line.endswith("}"))
    wait_for_row(
        Path(args.wait_for),
        lambda row: row["step"] > last and row["committed"] and row["replicas"] == 1,
    )


def wait_for_row(log: Path, wanted, timeout: float = 120.0) -> None:
    """Until a row of the step log `log` is `wanted` (polling the file, with a deadline)."""
    deadline = time.monotonic() + timeout
    while not (
        log.exists()
        and any(wanted(json.loads(line)) for line in log.read_text().splitlines() if line.endswith("}"))
    ):
        if time.monotonic() > deadline:
            raise SystemExit(f"no row of {log} was as wanted within {timeout} s")
        time.sleep(0.02)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--killed", type=int, default=1)  # the group --kills applies to
    p.add_argument(
        "--kills", default=""
    )  # "offset@where,..." (where: start, allreduce, end), one per attempt
    p.add_argument("--attempt", type=int, default=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    p.add_argument("--kill-rank", type=int, default=0)  # the rank of the group that dies
    p.add_argument("--skip-at", type=int, default=None)  # group --killed skips this step (offset), alive
    p.add_argument("--group-strategy", choices=["fsdp", "ddp"], default=None)  # a torchrun job of such ranks
    p.add_argument("--restarts", type=int, default=0)  # > 0: relaunch killed attempts (see `relaunch`)
    p.add_argument("--wait-for", default=None)  # the survivor's step log (see `relaunch`)
    p.add_argument("--after-rejoin", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--quorum-timeout", type=float, default=60.0)  # FaultTolerance.quorum_timeout_s
    p.add_argument("--max-steps", type=int, default=100000)  # a bound; the drill stops the groups itself
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=1)  # > 1: DiLoCo
    p.add_argument("--optimizer", default="sgd")  # Regression's: sgd or adamw
    p.add_argument("--sync-optimizer-state", action="store_true")  # FaultTolerance.sync_optimizer_state
    p.add_argument("--sync-warmup-steps", type=int, default=0)  # FaultTolerance.sync_warmup_steps
    p.add_argument("--sync-combined-second-moment", action="store_true")  # FaultTolerance's
    p.add_argument("--quorum-every", type=int, default=1)  # FaultTolerance.quorum_every
    p.add_argument("--max-quorum-interval", type=float, default=10.0)  # FaultTolerance.max_quorum_interval_s
    p.add_argument("--save-at", type=int, default=None)  # a checkpoint (ROOT/checkpoint) after this step
    p.add_argument("--resume", default=None)  # the fit's ckpt_path
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    Path(args.root).mkdir(parents=True, exist_ok=True)
    if args.restarts:
        relaunch(args)
        return
    # start-up overlaps the other group's; training waits for the survivor (after torchrun's restarts too)
    if args.wait_for:
        wait_for_the_survivor(args, args.attempt)
    train(args)


if __name__ == "__main__":
    main()
