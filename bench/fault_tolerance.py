"""Per-step fault tolerance (torchft) on 2 replica groups of one process: what it costs and what it saves.

1. Step time with and without torchft on the same MLP sizes (the tiny one: the fixed cost; the largest: a
   step of >= 100 ms here): plain DDP of 2 gloo processes under torchrun vs 2 replica groups of 1 process
   under a lighthouse. Prints both, their ratio (target <= 1.1 on the >= 100 ms step) and the fixed cost
   per step in ms (quorum + gradient all-reduce through torchft + commit vote).
2. A kill: group 1 SIGKILLs itself at step 30 and is relaunched as a fresh process. Prints the survivor's
   stall (its longest step around the kill: the lighthouse's heartbeat timeout plus the discarded step),
   its solo steps during the outage, the rejoin time (relaunch to the group's first committed step: start-up,
   quorum, live recovery) and the survivor's step that sent the state.
3. The projection: effective training time at Llama 3's failure rate (466 interruptions in 54 days) for
   restart-from-checkpoint vs live recovery, from the measured costs and the stated assumptions.

`python bench/fault_tolerance.py` (about 3 minutes here). Numbers on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from common import StepClock  # noqa: E402

from callbacks import Callback  # noqa: E402
from trainer import Trainer, TrainModule  # noqa: E402
from trainer.fault_tolerance import FaultTolerance  # noqa: E402

WIDTHS = (16, 256, 1024)  # 1.1K, 0.5M, 8.4M parameters
BATCH, STEPS, SKIP = 64, 40, 10
KILL_AT, AFTER_REJOIN = 30, 20
LLAMA3_MTBF_S = 54 * 86400 / 466  # 16K GPUs: one interruption every 2.8 h


class MLP(TrainModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def loader(width: int, steps: int, groups: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH * groups, width, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=BATCH)


class Drill(Callback):
    """Group 1 dies at KILL_AT; every step's end time and participants go to a JSONL file; both groups
    stop AFTER_REJOIN steps after group 1 rejoined."""

    def __init__(self, path: Path, replica: int, rejoining: bool) -> None:
        self.file, self.replica, self.rejoining = open(path, "a"), replica, rejoining
        self.seen: list[int] = []
        self.back_at: int | None = None

    def on_train_batch_start(self, trainer, module, batch_idx):
        n = trainer._fit_loop.replicas.participants
        dropped = any(a > b for a, b in zip(self.seen[:-1], self.seen[1:], strict=True))
        if self.back_at is None and (self.rejoining or (dropped and n > self.seen[-1])):
            self.back_at = trainer.global_step
        self.seen.append(n)

    def on_train_batch_end(self, trainer, module, outputs):
        step = trainer.global_step - 1
        row = {"t": time.time(), "step": step, "n": self.seen[-1], "committed": not outputs["skipped"]}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.replica == 1 and not self.rejoining and step + 1 == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.back_at is not None and trainer.global_step >= self.back_at + AFTER_REJOIN:
            trainer.should_stop = True


def fit(
    width: int, out: Path, ft: FaultTolerance | None, callbacks: list, steps: int, groups: int
) -> list[float]:
    clock = StepClock()
    trainer = Trainer(
        strategy="ddp" if ft is None else "auto",
        max_steps=steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1000,
        callbacks=[clock, *callbacks],
        default_root_dir=str(out),
        fault_tolerance=ft,
    )
    trainer.fit(MLP(width), loader(width, min(steps, STEPS), groups))  # the drill's epochs repeat the data
    return clock.stamps


def rank_main(args: argparse.Namespace) -> None:
    """A process of one arm: the DDP ranks (under torchrun) or one replica group."""
    torch.set_num_threads(1)
    out = Path(args.out)
    # one lighthouse per fit: one serves one run (the next fit's groups must not meet this one's)
    lighthouses = (args.lighthouses or "").split(",")
    ft = [None if args.arm == "ddp" else FaultTolerance(lh, args.replica, timeout_s=30) for lh in lighthouses]
    if args.arm != "rejoin":
        times = {}
        for i, width in enumerate(WIDTHS):
            stamps = fit(width, out / f"{args.arm}-{width}", ft[i % len(ft)], [], STEPS, 2)
            times[width] = statistics.median(
                b - a for a, b in zip(stamps[SKIP:-1], stamps[SKIP + 1 :], strict=True)
            )
        if args.arm == "ddp" and int(os.environ.get("RANK", "0")) != 0:
            return
        (out / f"{args.arm}-{args.replica}.json").write_text(json.dumps(times))
        if args.arm == "ddp":
            return
    started = time.time()
    drill = Drill(out / f"drill-{args.replica}.jsonl", args.replica, args.arm == "rejoin")
    fit(WIDTHS[1], out / f"drill-{args.replica}-{args.arm}", ft[-1], [drill], 100000, 2)
    if args.arm == "rejoin":
        (out / "rejoin.json").write_text(json.dumps({"started": started}))


def spawn(args: list[str], out: Path, name: str, torchrun: int = 0) -> subprocess.Popen:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    cmd = [*(launcher if torchrun else [sys.executable]), __file__, "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "WANDB_MODE": "offline"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(out / f"{name}.err", "w"))


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    return [p.wait(timeout=timeout) for p in procs]


def main() -> None:
    from trainer.fault_tolerance.lighthouse import start_lighthouse

    out = Path(tempfile.mkdtemp(prefix="bench-ft-"))
    servers = [start_lighthouse("127.0.0.1:0", heartbeat_timeout_ms=5000) for _ in range(len(WIDTHS) + 1)]
    address = ",".join(f"127.0.0.1:{s.address().rpartition(':')[2]}" for s in servers)
    try:
        assert wait_all([spawn(["--arm", "ddp"], out, "ddp", torchrun=2)], 900) == [0], (
            out / "ddp.err"
        ).read_text()[-2000:]
        groups = [
            spawn(["--arm", "ft", "--replica", str(r), "--lighthouses", address], out, f"ft{r}")
            for r in (0, 1)
        ]
        # group 1 dies at KILL_AT of the drill; relaunched as a fresh process as soon as it is gone
        groups[1].wait(timeout=900)
        relaunched_at = time.time()
        rejoin = spawn(["--arm", "rejoin", "--replica", "1", "--lighthouses", address], out, "rejoin")
        assert wait_all([groups[0], rejoin], 900) == [0, 0], (out / "ft0.err").read_text()[-2000:]
    finally:
        for server in servers:
            server.shutdown()
    report(out, relaunched_at)


def report(out: Path, relaunched_at: float) -> None:
    ddp = json.loads((out / "ddp-0.json").read_text())
    ft = json.loads((out / "ft-0.json").read_text())
    print(f"{'MLP width':>10} {'params':>8} {'DDP ms':>8} {'torchft ms':>11} {'ratio':>6} {'fixed ms':>9}")
    for width in WIDTHS:
        params = 8 * width * width + 5 * width
        a, b = ddp[str(width)] * 1e3, ft[str(width)] * 1e3
        print(f"{width:>10} {params:>8} {a:>8.1f} {b:>11.1f} {b / a:>6.2f} {b - a:>9.1f}")
    rows = [json.loads(line) for line in (out / "drill-0.jsonl").read_text().splitlines()]
    back = [json.loads(line) for line in (out / "drill-1.jsonl").read_text().splitlines()]
    gaps = [(b["t"] - a["t"], b) for a, b in zip(rows, rows[1:], strict=False)]
    stall, at = max((g, b) for g, b in gaps if b["step"] <= KILL_AT + 2)
    solo = sum(1 for r in rows if r["n"] == 1 and r["committed"])
    first_back = min((r for r in back if r["step"] > KILL_AT and r["committed"]), key=lambda r: r["t"])
    rejoin_s = first_back["t"] - relaunched_at
    startup_s = json.loads((out / "rejoin.json").read_text())["started"] - relaunched_at
    sent = next(g for g, b in gaps if b["step"] == first_back["step"])
    step_s = ft[str(WIDTHS[1])]
    print(f"stall after the kill: {stall:.2f} s (survivor's step {at['step']}; heartbeat timeout 5 s)")
    print(f"solo steps during the outage: {solo}; discarded: {sum(1 for r in rows if not r['committed'])}")
    print(
        f"rejoin: {rejoin_s:.2f} s from relaunch to its first committed step ({startup_s:.2f} s of it start-up "
        f"to fit); the survivor's step that sent the state: {sent * 1e3:.0f} ms"
    )
    project(stall, rejoin_s, step_s, ft[str(WIDTHS[-1])] / ddp[str(WIDTHS[-1])])


def project(stall_s: float, rejoin_s: float, step_s: float, ratio: float) -> None:
    """Effective training time at Llama 3's interruption rate, for a job of R = 16 replica groups."""
    groups, interval_s, save_s, restart_s = 16, 1800.0, 30.0, 600.0  # assumptions, printed below
    lost_ckpt = restart_s + interval_s / 2  # per failure: restart and reload, half an interval redone
    ckpt = (1 - save_s / interval_s) * (1 - lost_ckpt / LLAMA3_MTBF_S)
    # live: the survivors stall once, then run at (R-1)/R until the group is back (its own restart_s)
    lost_live = stall_s + step_s + restart_s / groups
    live = (1 - save_s / interval_s) * (1 - lost_live / LLAMA3_MTBF_S) / ratio
    print(
        f"projection at Llama 3's rate (one interruption per {LLAMA3_MTBF_S / 3600:.1f} h), {groups} replica groups, "
        f"checkpoint every {interval_s / 60:.0f} min ({save_s:.0f} s to save), {restart_s:.0f} s to restart a job: "
        f"restart-from-checkpoint {ckpt:.1%}, live recovery {live:.1%} (per-step cost {ratio:.2f}x, "
        f"stall {stall_s:.1f} s, rejoin measured here {rejoin_s:.1f} s)"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arm", choices=["ddp", "ft", "rejoin"], default=None)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--lighthouses", default=None)  # one per fit: the overhead widths, then the drill
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rank_main(a) if a.arm else main()
