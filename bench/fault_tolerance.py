"""Per-step fault tolerance (torchft) on 2 replica groups of one process: what it costs and what it saves.

1. Step time with and without torchft on the same MLP sizes (the tiny one: the fixed cost; the largest: a
   step of >= 100 ms here): plain DDP of 2 gloo processes under torchrun vs 2 replica groups of 1 process
   under a lighthouse, in interleaved rounds (DDP, torchft, DDP, torchft: a drifting load hits both arms),
   for each configuration of CONFIGS (plain; 2 micro-batches of half the batch; a token-weighted loss; fp16
   with its loss scaler; with --group-size > 1, FSDP2 in each group) - the ones past `plain` and `fsdp` at
   every width but the smallest (`--widths 64`, on request: fp16's ~10 ms step on a CPU without fast fp16).
   Prints both (wall, and the process's CPU time), their ratio (targets: <= 1.02 on the >= 100 ms step,
   <= 1.1 on the ~10 ms one), each round's ratio and their median (the arms of a round run next to each
   other: the steadier figure where the load drifts) and the fixed cost per step in ms; then where
   torchft's per-step work goes on group 0 (quorum, all-reduce, commit vote, copies:
   trainer/fault_tolerance/costs.py), and rank 0's CPU per step by kind of thread in both arms (the
   training thread, gloo's, the DDP groups' ring, torchft's: thread_cpu.py), which on a machine with
   fewer cores than processes is where the fixed cost goes.
2. A kill: group 1 SIGKILLs itself at step 30 and is relaunched as a fresh process once the survivor has
   committed a step alone (so the survivor sees the outage). Prints the survivor's
   stall (its longest step around the kill: the lighthouse's heartbeat timeout, HEARTBEAT_TIMEOUT_MS),
   its solo steps during the outage, the rejoin time (relaunch to the group's first committed step: start-up,
   quorum, live recovery) and the survivor's step that sent the state.
3. The projection: effective training time at Llama 3's failure rate (466 interruptions in 54 days) for
   restart-from-checkpoint vs live recovery, from the measured costs and the stated assumptions.

`python bench/fault_tolerance.py [--rounds 2] [--configs plain,accumulate]` (about 4 minutes here with `plain`
alone; `--no-drill`: part 1 alone, `--rounds 0`: part 2 alone). `--group-size 2`: part 1 with replica groups of
2 DDP processes (each a torchrun job) against DDP of 4 (`--configs fsdp`: groups of 2 FSDP2 processes against
HSDP of 4, replicated over 2; `fsdp-clip`: both clip the gradients by their norm, whose all-reduce over
the group carries the group's commit vote); `--flat`: torchft's arm averages over the groups after
the backward (one flat copy per dtype) instead of from it (overlap.py, overlap_ddp.py): the path before.
`--quorum-every 8`: torchft's arm and the drill's groups take a quorum every 8 steps while the groups stay in
step (cadence.py). `--peer-vote` (groups of several processes): the DDP/HSDP arm also sums two numbers over each
group's ranks before every optimizer step, where torchft's arm takes its commit vote (group_calls.py
GroupVote): what one more wait for a group's slowest rank costs on this machine, apart from torchft.
`--peer-ring` (DDP groups): the DDP arm averages as torchft's DDP groups do (overlap_ddp.py: around each group's
ring, the slice summed over the groups on a plain gloo group) without torchft: what that average costs here.
Numbers on a shared machine are noisy; every wait has a deadline (DEADLINE_S) and a failed one ends the bench
with one line naming it.
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
from collections.abc import Callable
from pathlib import Path

import torch
from thread_cpu import KINDS, machine_cpu, thread_cpu  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback  # noqa: E402
from strategies import FSDPStrategy  # noqa: E402
from trainer import Trainer, TrainModule  # noqa: E402
from trainer.fault_tolerance import FaultTolerance  # noqa: E402
from trainer.fault_tolerance.config import HEARTBEAT_TIMEOUT_MS  # noqa: E402
from trainer.fault_tolerance.costs import PARTS  # noqa: E402

WIDTHS = (16, 256, 1024)  # the default: 1.1K, 0.5M, 8.4M parameters
# each width's batch: the largest arm's makes plain DDP's step >= 100 ms here; 64 (on request): fp16's ~10 ms
# step here (this CPU's fp16 matmul makes 256's ~100 ms, 16's ~4 ms)
BATCHES = {16: 64, 64: 64, 256: 64, 1024: 192}
# each configuration: the Trainer's arguments, whether the loss reports its tokens (all of the batch's
# samples count), micro-batches per step (each of batch / micro-batches samples: the same step's work)
CONFIGS = {
    "plain": ({}, False, 1),
    "accumulate": ({"accumulate_grad_batches": 2}, False, 2),
    "tokens": ({}, True, 1),
    "fp16": ({"precision": "16-mixed"}, False, 1),
    # --group-size > 1 only: FSDP2 inside each group, against HSDP (the same sharding, replicated over the
    # groups by FSDP itself) of every process
    "fsdp": ({}, False, 1),
    # the same, the gradients clipped by their norm (as LLM recipes do): the group's commit vote then rides
    # the norm's all-reduce over the group, which the HSDP arm makes too
    "fsdp-clip": ({"gradient_clip_val": 1.0}, False, 1),
}
FSDP = ("fsdp", "fsdp-clip")  # the configurations of FSDP2 inside groups of several processes
# steps per fit: ~1-3 s of steps at every width (30 steps of a ~7 ms step moved its median by 0.1-0.3 between
# rounds here), 40 at the >= 100 ms one
STEPS, SKIP = {16: 400, 64: 400, 256: 400, 1024: 40}, 10
KILL_AT, AFTER_REJOIN, DRILL_STEPS = (
    30,
    20,
    20000,
)  # the drill's fits end by AFTER_REJOIN, DRILL_STEPS at most
# KILL_AT counts group 1's own steps: it joins a running job, healing to the survivor's step first
DEADLINE_S = 600  # every wait of the bench: a launch, the kill, the outage, the rejoin, the end
LLAMA3_MTBF_S = 54 * 86400 / 466  # 16K GPUs: one interruption every 2.8 h


class MLP(TrainModule):
    def __init__(self, width: int, tokens: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )
        self.tokens = tokens

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        return {"loss": loss, "num_tokens": torch.tensor(len(x))} if self.tokens else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def loader(width: int, steps: int, groups: int, micro_batches: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCHES[width] * groups, width, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=BATCHES[width] // micro_batches)


class Clock(Callback):
    """Wall and CPU time (this process, every thread: gloo's included) at the end of every step, with torchft
    the running seconds of each part of its per-step work (trainer/fault_tolerance/costs.py), and the CPU
    time by kind of thread over the steps after SKIP (`threads`: ms per step)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.parts: dict[str, list[float]] = {part: [] for part in PARTS}
        self.threads_at: dict[str, float] = {}
        self.threads: dict[str, float] = {}
        self.machine_at = (0.0, 0.0)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if len(self.wall) == SKIP + 1:  # read twice a fit only: reading every thread's counter takes time
            self.threads_at, self.machine_at = thread_cpu(), machine_cpu()
        replicas = trainer._fit_loop.replicas
        for part, seconds in replicas.costs.seconds.items() if replicas is not None else ():
            self.parts[part].append(seconds)

    def on_train_end(self, trainer, module):
        steps = len(self.wall) - SKIP - 1
        if steps > 0:  # (a fit of SKIP steps or fewer took no first reading)
            now = thread_cpu()
            self.threads = {kind: (now[kind] - self.threads_at[kind]) / steps for kind in now}
            busy, idle = (b - a for a, b in zip(self.machine_at, machine_cpu(), strict=True))
            self.threads.update({"machine busy": busy / steps, "machine idle": idle / steps})


class PeerVote(Callback):
    """The peer arm's stand-in for a group's commit vote: two numbers summed over the ranks of this rank's
    group ({0..g-1}, {g..2g-1}: HSDP's shard groups) before every optimizer step."""

    def __init__(self, group_size: int) -> None:
        self.group_size, self.group = group_size, None

    def on_train_start(self, trainer, module):  # (the Trainer starts the process group)
        self.group, _ = torch.distributed.new_subgroups(self.group_size)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        torch.distributed.all_reduce(torch.zeros(2), group=self.group)


class PeerRing(Callback):
    """The peer arm's average as a torchft DDP group's (`OverlappedGroupAverage`): DDP's all-reduce replaced by
    the ring's reduce-scatter in each group of `group_size` ranks, the slice's sum over the groups (rank r of
    every group, on a plain gloo group in place of torchft's) and the ring's all-gather; the mean over every
    rank, as DDP's."""

    def __init__(self, group_size: int) -> None:
        self.group_size, self.average = group_size, None

    def on_train_start(self, trainer, module):  # (the Trainer starts the process group and wraps DDP)
        from types import SimpleNamespace

        from trainer.fault_tolerance.overlap_ddp import OverlappedGroupAverage

        dist, g = torch.distributed, self.group_size
        group, _ = dist.new_subgroups(g)
        across, _ = dist.new_subgroups_by_enumeration([[r, r + g] for r in range(g)])
        ddp = trainer.strategy.model
        # DDP over the group's ranks, as the average sees a torchft group's (its hook stays on DDP itself)
        view = SimpleNamespace(
            module=ddp.module,
            process_group=group,
            _comm_hooks=ddp._comm_hooks,
            register_comm_hook=ddp.register_comm_hook,
        )
        self.average = OverlappedGroupAverage(view, CrossSum(across))

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        scaler = trainer.strategy.precision.scaler
        inv_scale = 1.0 / scaler.get_scale() if scaler is not None else 1.0
        self.average.arm(2, trainer.accumulate_grad_batches, inv_scale)

    def on_train_end(self, trainer, module):
        self.average.remove()


class CrossSum:
    """`PeerRing`'s sum over the groups: an all-reduce on `group`, as `DirectSum` launches torchft's."""

    def __init__(self, group) -> None:
        self.group, self.manager = group, self

    def allreduce(self, tensor: torch.Tensor, reduce_op) -> Launched:
        return Launched(torch.distributed.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True))

    def report_error(self, err: BaseException) -> None:
        raise err


class Launched:
    """A launched all-reduce of `CrossSum`'s; `wait` says it succeeded (a failure raises)."""

    def __init__(self, work) -> None:
        self.work = work

    def wait(self) -> bool:
        self.work.wait()
        return True


def per_step(stamps: list[float], quantile: float = 0.5) -> float:
    """The median step (or another quantile) after SKIP warm-up steps."""
    steps = sorted(b - a for a, b in zip(stamps[SKIP:-1], stamps[SKIP + 1 :], strict=True))
    return statistics.median(steps) if quantile == 0.5 else steps[int(quantile * (len(steps) - 1))]


class Drill(Callback):
    """Group 1 dies after its KILL_AT-th step (that step committed); every step's end time and participants go to a
    JSONL file (one per incarnation); both groups stop AFTER_REJOIN steps after group 1 rejoined: the
    relaunched group counts from its first step, the survivor from its first 2-participant step after it
    went solo (the bench relaunches group 1 only once the survivor committed a solo step)."""

    def __init__(self, path: Path, replica: int, rejoining: bool) -> None:
        self.file, self.replica, self.rejoining = open(path, "a"), replica, rejoining
        self.seen: list[int] = []
        self.back_at: int | None = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        n = trainer._fit_loop.replicas.participants
        dropped = any(a > b for a, b in zip(self.seen[:-1], self.seen[1:], strict=True))
        if self.back_at is None and (self.rejoining or (dropped and n > self.seen[-1])):
            self.back_at = trainer.global_step
        self.seen.append(n)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        row = {"t": time.time(), "step": step, "n": self.seen[-1], "committed": not outputs["skipped"]}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.replica == 1 and not self.rejoining and len(self.seen) == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.back_at is not None and trainer.global_step >= self.back_at + AFTER_REJOIN:
            trainer.should_stop = True


def fit(
    width: int,
    out: Path,
    ft: FaultTolerance | None,
    callbacks: list,
    steps: int,
    config: str = "plain",
    group_size: int = 1,
) -> None:
    kwargs, tokens, micro_batches = CONFIGS[config]
    if config in FSDP:  # groups of group_size FSDP ranks, or HSDP of two such groups
        strategy = FSDPStrategy(replicate=2 if ft is None else 1)
    else:
        strategy = "ddp" if ft is None or group_size > 1 else "auto"
    trainer = Trainer(
        strategy=strategy,
        max_steps=steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1000,
        callbacks=callbacks,
        default_root_dir=str(out),
        fault_tolerance=ft,
        **kwargs,
    )
    # the drill's epochs repeat the data
    trainer.fit(MLP(width, tokens), loader(width, min(steps, STEPS[width]), 2 * group_size, micro_batches))


def rank_main(args: argparse.Namespace) -> None:
    """A process of one arm: the DDP ranks (under torchrun), one replica group, or a drill's group."""
    torch.set_num_threads(1)
    out = Path(args.out)
    # one lighthouse per fit: one serves one run (the next fit's groups must not meet this one's)
    lighthouses = (args.lighthouses or "").split(",")
    every = args.quorum_every
    ft = [
        FaultTolerance(lh, args.replica, timeout_s=30, quorum_every=every) if lh else None
        for lh in lighthouses
    ]
    if args.flat:  # the average after the backward, as before it was launched from it
        import trainer.fault_tolerance.replica_group as replica_group

        replica_group._overlap_is_valid = lambda trainer: False
        replica_group.overlap_in_group = lambda *args: None
    if args.arm in ("ddp", "ft"):
        times = {}
        for i, (config, width) in enumerate(fits(args.configs, args.widths)):
            clock = Clock()
            folder = out / f"{args.arm}-{args.round}-{config}-{width}"
            # the DDP arm's stand-ins for what torchft's groups do (the bench runs 2 groups)
            peers = [PeerVote(args.group_size)] if args.peer_vote and args.arm == "ddp" else []
            peers += [PeerRing(args.group_size)] if args.peer_ring and args.arm == "ddp" else []
            fit(width, folder, ft[i % len(ft)], [clock, *peers], STEPS[width], config, args.group_size)
            # the fastest tenth of the steps as well: other processes' load only adds time, so it varies less
            times[f"{config}/{width}"] = {
                "wall": per_step(clock.wall),
                "cpu": per_step(clock.cpu),
                "p10": per_step(clock.wall, 0.1),
            }
            times[f"{config}/{width}"].update(
                {part: per_step(seconds) for part, seconds in clock.parts.items() if seconds}
            )
            times[f"{config}/{width}"].update({f"cpu {kind}": s for kind, s in clock.threads.items()})
        if int(os.environ.get("RANK", "0")) == 0:  # DDP: rank 0's; torchft: each group writes its own
            (out / f"{args.arm}-{args.round}-{args.replica}.json").write_text(json.dumps(times))
        return
    name = f"drill-{args.replica}" + ("-rejoin" if args.arm == "rejoin" else "")
    (out / f"{name}.started").write_text(json.dumps(time.time()))
    drill = Drill(out / f"{name}.jsonl", args.replica, args.arm == "rejoin")
    fit(WIDTHS[1], out / name, ft[0], [drill], DRILL_STEPS)


def widths_arg(text: str) -> tuple[int, ...]:
    """--widths' value: some of BATCHES' widths, comma-separated (a one-line error otherwise)."""
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or set(widths) - set(BATCHES):
        raise argparse.ArgumentTypeError(
            f"{text!r}: allowed: some of {','.join(map(str, BATCHES))}, comma-separated"
        )
    return widths


def fits(configs: str, widths: tuple[int, ...] = WIDTHS) -> list[tuple[str, int]]:
    """The (configuration, width) fits of one arm: `plain` and FSDP's (its shortest step here ~15 ms) at each
    of `widths`, the others at each but the smallest (WIDTHS[0]: the fixed cost)."""
    return [
        (config, width)
        for config in configs.split(",")
        for width in widths
        if config in ("plain", *FSDP) or width != WIDTHS[0]
    ]


def spawn(args: list[str], out: Path, name: str, torchrun: int = 0) -> subprocess.Popen:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    cmd = [*(launcher if torchrun else [sys.executable]), __file__, "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "WANDB_MODE": "offline"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(out / f"{name}.err", "w"))


class BenchFailed(Exception):
    """A wait of the bench ran past its deadline, or a process it waited for failed (one line)."""


def wait_until(what: str, ready: Callable[[], bool], procs: list[subprocess.Popen], log: Path) -> None:
    """Poll `ready` until it holds; BenchFailed naming `what` after DEADLINE_S or when one of `procs` ended."""
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        ended = [p for p in procs if p.poll() is not None]
        if ended:
            raise BenchFailed(
                f"waiting for {what}: a process ended with {ended[0].returncode} first (see {log})"
            )
        if time.monotonic() > deadline:
            raise BenchFailed(f"waiting for {what}: not within {DEADLINE_S} s (see {log})")
        time.sleep(0.05)


def wait_exit(what: str, proc: subprocess.Popen, log: Path, code: int | None = 0) -> None:
    """Wait for `proc` to exit (with `code`, unless None); BenchFailed naming `what` otherwise."""
    try:
        got = proc.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        raise BenchFailed(
            f"waiting for {what} to exit: still running after {DEADLINE_S} s (see {log})"
        ) from None
    if code is not None and got != code:
        lines = log.read_text().splitlines() if log.exists() else []
        said = [line for line in lines if "Error" in line] or lines or [""]  # the error, else the last line
        raise BenchFailed(f"{what} exited with {got}, not {code} (see {log}: {said[-1].strip()[-300:]})")


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main(
    rounds: int,
    drill: bool,
    configs: str,
    group_size: int = 1,
    flat: bool = False,
    quorum_every: int = 1,
    peer_vote: bool = False,
    peer_ring: bool = False,
    widths: tuple[int, ...] = WIDTHS,
) -> None:
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouses here log every quorum at INFO otherwise
    from trainer.fault_tolerance.lighthouse import start_lighthouse

    out = Path(tempfile.mkdtemp(prefix="bench-ft-"))
    # the machine's load (other processes share its cores): the wall ratios mean little when it is high
    print(f"bench folder: {out}; load average {os.getloadavg()[0]:.2f}", flush=True)
    procs: list[subprocess.Popen] = []
    servers = []

    def lighthouses(n: int, min_replicas: int) -> str:
        new = [
            start_lighthouse("127.0.0.1:0", min_replicas, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
            for _ in range(n)
        ]
        servers.extend(new)
        return ",".join(f"127.0.0.1:{s.address().rpartition(':')[2]}" for s in new)

    try:
        for r in range(rounds):  # interleaved: DDP, torchft, DDP, torchft... (load drift hits both arms)
            arms = ["--round", str(r), "--configs", configs, "--group-size", str(group_size)]
            arms += ["--widths", ",".join(map(str, widths))]
            arms += ["--flat"] if flat else []
            arms += ["--quorum-every", str(quorum_every)]
            arms += ["--peer-vote"] if peer_vote else []
            arms += ["--peer-ring"] if peer_ring else []
            ddp = spawn(["--arm", "ddp", *arms], out, f"ddp-{r}", torchrun=2 * group_size)
            procs.append(ddp)
            wait_exit(f"round {r}'s DDP arm", ddp, out / f"ddp-{r}.err")
            # both groups in every step's quorum: a group that starts a fit first would otherwise train
            # alone, and the other would heal from it mid-fit (its clock then misses the steps)
            address = lighthouses(len(fits(configs, widths)), min_replicas=2)
            groups = [
                spawn(
                    ["--arm", "ft", *arms, "--replica", str(g), "--lighthouses", address],
                    out,
                    f"ft-{r}-{g}",
                    torchrun=group_size if group_size > 1 else 0,
                )
                for g in (0, 1)
            ]
            procs.extend(groups)
            for g, proc in enumerate(groups):
                wait_exit(f"round {r}'s torchft group {g}", proc, out / f"ft-{r}-{g}.err")
        if drill:
            relaunched_at, killed_at = kill_drill(out, lighthouses(1, min_replicas=1), procs, quorum_every)
    except BenchFailed as err:
        print(f"bench failed: {err}")
        sys.exit(1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for server in servers:
            server.shutdown()
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if rounds:
        for config in configs.split(","):
            report_steps(out, rounds, config, widths)
    if drill:
        stall, rejoin = report_drill(out, relaunched_at, killed_at)
    if rounds and drill:
        # the projection's per-step cost: the median of the first configuration's rounds' ratios
        first = configs.split(",")[0]
        project(
            stall,
            rejoin,
            arm(out, rounds, "ft", f"{first}/{WIDTHS[1]}", "wall") / 1e3,
            statistics.median(paired(out, rounds, f"{first}/{WIDTHS[-1]}")),
        )


def kill_drill(
    out: Path, address: str, procs: list[subprocess.Popen], quorum_every: int
) -> tuple[float, int]:
    """Group 1 killed and relaunched under a running group 0 (see the module's note); when it was
    relaunched (time.time()) and its last step before the kill."""
    every = ["--lighthouses", address, "--quorum-every", str(quorum_every)]
    drill = [spawn(["--arm", "drill", "--replica", "0", *every], out, "drill-0")]
    procs.extend(drill)
    # group 1 joins the running job (as a relaunch does), so the survivor's participants go 1, 2, 1, 2
    wait_until(
        "the survivor's first drill step",
        lambda: bool(rows(out / "drill-0.jsonl")),
        drill,
        out / "drill-0.err",
    )
    drill.append(spawn(["--arm", "drill", "--replica", "1", *every], out, "drill-1"))
    procs.append(drill[1])
    # group 1 dies after KILL_AT steps; relaunched only once the survivor committed a step alone, so that
    # the survivor sees the outage (a relaunch quicker than the heartbeat timeout would join the very
    # next quorum: the survivor never went solo, and never knew when to stop)
    wait_exit(
        f"group 1's SIGKILL after its {KILL_AT}th drill step",
        drill[1],
        out / "drill-1.err",
        code=-signal.SIGKILL,
    )
    killed_at = rows(out / "drill-1.jsonl")[-1]["step"]
    wait_until(
        "the survivor's first solo committed step",
        lambda: any(
            r["step"] > killed_at and r["n"] == 1 and r["committed"] for r in rows(out / "drill-0.jsonl")
        ),
        [drill[0]],
        out / "drill-0.err",
    )
    relaunched_at = time.time()
    rejoin = spawn(["--arm", "rejoin", "--replica", "1", *every], out, "drill-1-rejoin")
    procs.append(rejoin)
    wait_exit("the relaunched group 1", rejoin, out / "drill-1-rejoin.err")
    wait_exit("the survivor (group 0)", drill[0], out / "drill-0.err")
    return relaunched_at, killed_at


def each(out: Path, rounds: int, name: str, key: str, kind: str) -> list[float]:
    """ms per step of arm `name` in each round (rank 0 / group 0) at `key` ("configuration/width")."""
    return [json.loads((out / f"{name}-{r}-0.json").read_text())[key][kind] * 1e3 for r in range(rounds)]


def arm(out: Path, rounds: int, name: str, key: str, kind: str) -> float:
    """The median over rounds of `each`."""
    return statistics.median(each(out, rounds, name, key, kind))


def paired(out: Path, rounds: int, key: str) -> list[float]:
    """torchft's wall time per step over DDP's, round by round: the two arms of a round ran next to each
    other, so a load that drifts between rounds moves both."""
    ddp, ft = each(out, rounds, "ddp", key, "wall"), each(out, rounds, "ft", key, "wall")
    return [b / a for a, b in zip(ddp, ft, strict=True)]


def report_steps(out: Path, rounds: int, config: str, of: tuple[int, ...]) -> None:
    """The per-step table (DDP vs torchft) of `config` at widths `of` and where torchft's per-step work goes."""
    widths = [width for name, width in fits(config, of)]
    print(
        f"configuration {config!r}: per step, median of {rounds} interleaved rounds (each the median of steps {SKIP + 1}-{STEPS[1024]} at width 1024, -{STEPS[256]} below); "
        "wall and this process's CPU time (rank 0 / group 0); p10 ratio: of the 10th-percentile steps, which "
        "another process's load disturbs less; then each round's wall ratio and their median (paired: "
        "a load that drifts between rounds moves both arms of a round)"
    )
    print(
        f"{'MLP width':>10} {'params':>8} {'batch':>6} {'DDP ms':>7} {'torchft ms':>11} {'ratio':>6} "
        f"{'fixed ms':>9} {'DDP cpu':>8} {'ft cpu':>7} {'cpu ratio':>9} {'fixed cpu':>9} {'p10 ratio':>9}  "
        "wall ratio per round, median"
    )
    for width in widths:
        params, key = 8 * width * width + 5 * width, f"{config}/{width}"
        a, b = arm(out, rounds, "ddp", key, "wall"), arm(out, rounds, "ft", key, "wall")
        ca, cb = arm(out, rounds, "ddp", key, "cpu"), arm(out, rounds, "ft", key, "cpu")
        p10 = arm(out, rounds, "ft", key, "p10") / arm(out, rounds, "ddp", key, "p10")
        per_round = paired(out, rounds, key)
        print(
            f"{width:>10} {params:>8} {BATCHES[width]:>6} {a:>7.1f} {b:>11.1f} {b / a:>6.2f} {b - a:>9.1f} "
            f"{ca:>8.1f} {cb:>7.1f} {cb / ca:>9.2f} {cb - ca:>9.1f} {p10:>9.2f}  "
            + " ".join(f"{r:.2f}" for r in per_round)
            + f", {statistics.median(per_round):.2f}"
        )
    print(
        "where torchft's per-step work goes (group 0, ms/step, medians as above): quorum = waiting for the "
        "step's quorum, allreduce = launching the cross-group averages and waiting for what the backward did "
        "not hide, commit = the commit vote, copies = gradients into and out of the reduce buffers"
    )
    print(f"{'MLP width':>10} " + " ".join(f"{part:>9}" for part in PARTS) + f" {'sum':>7} {'fixed ms':>9}")
    for width in widths:
        key = f"{config}/{width}"
        parts = [arm(out, rounds, "ft", key, part) for part in PARTS]
        fixed = arm(out, rounds, "ft", key, "wall") - arm(out, rounds, "ddp", key, "wall")
        print(f"{width:>10} " + " ".join(f"{v:>9.2f}" for v in parts) + f" {sum(parts):>7.2f} {fixed:>9.1f}")
    report_threads(out, rounds, config, widths)


def report_threads(out: Path, rounds: int, config: str, widths: list[int]) -> None:
    """Rank 0's CPU per step by kind of thread in both arms (bench/thread_cpu.py), where /proc has them."""
    if f"cpu {KINDS[0]}" not in json.loads((out / "ddp-0-0.json").read_text())[f"{config}/{widths[0]}"]:
        return
    print(
        "where rank 0's CPU goes (ms/step, the mean over the steps after the first SKIP, medians over rounds): "
        "main = the training thread, gloo = gloo's threads (every process group's), ring = the DDP groups' "
        "ring, torchft = its manager's threads and its quorum thread; the lighthouse (here in the bench's "
        "own process) is not counted; machine busy / idle: every CPU's time in the same steps, every "
        "process's (the arm's others, the lighthouse, anything else running): busy more in one arm is work "
        "that competes for the cores, idle more is waiting"
    )
    machine = ("machine busy", "machine idle")
    print(
        f"{'MLP width':>10} {'arm':>8} "
        + " ".join(f"{kind:>8}" for kind in KINDS)
        + f" {'sum':>7} {'machine busy':>13} {'idle':>6}"
    )
    for width in widths:
        for name in ("ddp", "ft"):
            cpu = [arm(out, rounds, name, f"{config}/{width}", f"cpu {kind}") for kind in KINDS]
            busy, idle = (arm(out, rounds, name, f"{config}/{width}", f"cpu {kind}") for kind in machine)
            print(
                f"{width:>10} {name:>8} "
                + " ".join(f"{v:>8.2f}" for v in cpu)
                + f" {sum(cpu):>7.2f} {busy:>13.1f} {idle:>6.1f}"
            )


def report_drill(out: Path, relaunched_at: float, killed_at: int) -> tuple[float, float]:
    """The survivor's stall and the relaunched group's rejoin, in seconds (both also printed)."""
    survivor, back = rows(out / "drill-0.jsonl"), rows(out / "drill-1-rejoin.jsonl")
    gaps = [(b["t"] - a["t"], b) for a, b in zip(survivor, survivor[1:], strict=False)]
    stall, at = max((g, b) for g, b in gaps if killed_at < b["step"] <= killed_at + 3)
    solo = sum(1 for r in survivor if r["step"] > killed_at and r["n"] == 1 and r["committed"])
    first_back = min((r for r in back if r["committed"]), key=lambda r: r["t"])
    rejoin_s = first_back["t"] - relaunched_at
    startup_s = json.loads((out / "drill-1-rejoin.started").read_text()) - relaunched_at
    sent = next(g for g, b in gaps if b["step"] == first_back["step"])
    print(
        f"stall after the kill (group 1's last step {killed_at}): {stall:.2f} s (survivor's step {at['step']}; "
        f"heartbeat timeout {HEARTBEAT_TIMEOUT_MS / 1e3:g} s)"
    )
    print(
        f"solo steps during the outage: {solo}; discarded: {sum(1 for r in survivor if not r['committed'])}"
    )
    print(
        f"rejoin: {rejoin_s:.2f} s from relaunch to its first committed step, {first_back['step']} "
        f"({startup_s:.2f} s of it start-up to fit); the survivor's step that sent the state: {sent * 1e3:.0f} ms"
    )
    return stall, rejoin_s


def project(stall_s: float, rejoin_s: float, step_s: float, ratio: float) -> None:
    """Effective training time at Llama 3's interruption rate, for a job of R = 16 replica groups."""
    groups, interval_s, save_s, restart_s = 16, 1800.0, 30.0, 600.0  # assumptions, printed below
    lost_ckpt = restart_s + interval_s / 2  # per failure: restart and reload, half an interval redone
    ckpt = (1 - save_s / interval_s) * (1 - lost_ckpt / LLAMA3_MTBF_S)
    # live: the survivors stall once, then run at (R-1)/R until the group is back (its own restart_s)
    lost_live = stall_s + step_s + restart_s / groups
    cost = max(ratio, 1.0)  # torchft adds work to a step: a measured ratio below 1 is noise
    live = (1 - save_s / interval_s) * (1 - lost_live / LLAMA3_MTBF_S) / cost
    print(
        f"projection at Llama 3's rate (one interruption per {LLAMA3_MTBF_S / 3600:.1f} h), {groups} replica groups, "
        f"checkpoint every {interval_s / 60:.0f} min ({save_s:.0f} s to save), {restart_s:.0f} s to restart a job: "
        f"restart-from-checkpoint {ckpt:.1%}, live recovery {live:.1%} (per-step cost {cost:.2f}x from the measured {ratio:.2f}x, "
        f"stall {stall_s:.1f} s, rejoin measured here {rejoin_s:.1f} s)"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arm", choices=["ddp", "ft", "drill", "rejoin"], default=None)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--round", type=int, default=0)
    p.add_argument(
        "--rounds", type=int, default=2, help="interleaved DDP/torchft rounds (0: the drill alone)"
    )
    p.add_argument(
        "--no-drill", action="store_true", help="the per-step rounds alone (no kill, no projection)"
    )
    p.add_argument(
        "--configs",
        default=",".join(c for c in CONFIGS if c not in FSDP),  # FSDP: with --group-size > 1
        help=f"the configurations of the per-step rounds, comma-separated, of {', '.join(CONFIGS)}",
    )
    p.add_argument(
        "--group-size", type=int, default=1, help="processes per replica group (DDP inside it), part 1 only"
    )
    p.add_argument("--flat", action="store_true", help="torchft averages after the backward (the old path)")
    p.add_argument(
        "--quorum-every", type=int, default=1, help="FaultTolerance(quorum_every=...) of torchft's arm"
    )
    p.add_argument(
        "--peer-vote", action="store_true", help="the DDP/HSDP arm sums 2 numbers over each group per step"
    )
    p.add_argument(
        "--peer-ring",
        action="store_true",
        help="the DDP arm averages around each group's ring, without torchft",
    )
    p.add_argument(
        "--widths",
        type=widths_arg,
        default=WIDTHS,
        help=f"the MLP widths of part 1, comma-separated, of {','.join(map(str, BATCHES))} (with --no-drill)",
    )
    p.add_argument("--lighthouses", default=None)  # one per fit: the overhead widths, then the drill
    p.add_argument("--out", default=None)
    a = p.parse_args()
    unknown = set(a.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"--configs {a.configs}: {', '.join(sorted(unknown))} unknown; allowed: {', '.join(CONFIGS)}")
    if not fits(a.configs, a.widths):
        p.error(
            f"--widths {','.join(map(str, a.widths))}: no fit of --configs {a.configs} there; allowed: "
            f"{','.join(str(w) for w in BATCHES if w != WIDTHS[0])} for configurations but plain and FSDP's"
        )
    if a.widths != WIDTHS and not a.no_drill and not a.arm:
        p.error("--widths: the projection reads every width; allowed with --no-drill")
    if a.flat and a.quorum_every > 1:
        p.error("--flat with --quorum-every: the flags ride the overlapped average; allowed: one of them")
    if set(FSDP) & set(a.configs.split(",")) and a.group_size == 1:
        p.error(
            f"--configs {a.configs}: {'/'.join(FSDP)} is FSDP inside groups of several processes; allowed with --group-size 2 or more"
        )
    if a.group_size > 1 and not a.no_drill and not a.arm:
        p.error("--group-size: the drill runs groups of one process; allowed with --no-drill")
    if a.peer_vote and a.group_size == 1:
        p.error(
            "--peer-vote: a group of one process votes alone (no collective); allowed with --group-size 2 or more"
        )
    if a.peer_ring and (a.group_size == 1 or set(FSDP) & set(a.configs.split(","))):
        p.error(
            "--peer-ring: the average of DDP groups; allowed with --group-size 2 or more and no FSDP config"
        )
    if a.arm:
        rank_main(a)
    else:
        main(
            a.rounds,
            not a.no_drill,
            a.configs,
            a.group_size,
            a.flat,
            a.quorum_every,
            a.peer_vote,
            a.peer_ring,
            a.widths,
        )
