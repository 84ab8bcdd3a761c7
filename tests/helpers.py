"""What the tests share: tiny modules and data, a fit-and-return helper, parameter comparison,
checkpoint listing, and the one way a test launches processes (`run_ranks`, `start_ranks`, `call_ranks`, `run_cli`)."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import preloaded
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback
from trainer import Trainer, TrainModule
from trainer.data import PackedDataset, TokenLoader
from trainer.models.llama import LlamaConfig

TESTS = Path(__file__).parent
SEED = int(os.environ.get("TRAINER_TEST_SEED", "0"))  # every test's seed: a failure's report prints it
SCRIPTS = TESTS / "scripts"  # the rank scripts the tests launch (and import from)
# the distributed training scripts, by what they probe (their shared flags and fit: scripts/dist_common.py)
DDP_SCRIPT = SCRIPTS / "ddp_script.py"
FSDP_SCRIPT = SCRIPTS / "fsdp_script.py"
FAILURE_SCRIPT = SCRIPTS / "failure_script.py"
TIMING_SCRIPT = SCRIPTS / "timing_script.py"

# torchrun's, our spawner's and SLURM's variables: a child started by a test must not inherit a world
LAUNCHER_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
)

REPO = TESTS.parent
TINY = REPO / "recipes" / "llama_tiny.yaml"  # the tiny recipe the CLI tests run, with SMALL's overrides
SMALL = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "data.seq_len=64",
    "data.batch_size=4",
]

LLAMA = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, rope_theta=10000.0
)


class Regression(TrainModule):
    """A small MLP on a regression task; `dropout` makes the run depend on the RNG."""

    def __init__(self, dropout: float = 0.0, lr: float = 1e-2, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(32, 1)
        )
        self.lr, self.optimizer_name = lr, optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd-steplr":  # a scheduler of the module's own: the LR halves every step
            sgd = torch.optim.SGD(self.parameters(), lr=self.lr)
            halving = torch.optim.lr_scheduler.StepLR(sgd, 1, gamma=0.5)
            return {"optimizer": sgd, "lr_scheduler": {"scheduler": halving, "interval": "step"}}
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TokenCounted(Regression):
    """`Regression` by SGD whose loss, a mean over its batch, reports `tokens` items (None: no count)."""

    def __init__(self, tokens: int | None) -> None:
        super().__init__(lr=0.1, optimizer="sgd")
        self.tokens = tokens

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return {"loss": loss, "num_tokens": torch.tensor(self.tokens)} if self.tokens else loss


class ScriptedLoss(Regression):
    """The loss of batch i is `losses[i]` exactly (the gradients are zero)."""

    def __init__(self, losses):
        super().__init__()
        self.losses = losses

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self(x).mean() * 0.0 + self.losses[batch_idx]


def bench_module(name: str) -> types.ModuleType:
    """bench/<name>.py loaded as a module (the bench folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def regression_data(n: int = 256, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g))


def regression_loader(batch_size: int = 16, shuffle: bool = False, n: int = 256) -> DataLoader:
    return DataLoader(regression_data(n), batch_size=batch_size, shuffle=shuffle)


SEQ_LEN = 16


def token_loader(batch_size: int, vocab_size: int = LLAMA.vocab_size, n_tokens: int = 4000, seed: int = 1):
    """Random tokens (a fixed generator) in SEQ_LEN blocks, shuffled with `seed`: {"input_ids", "labels"}."""
    tokens = torch.randint(0, vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(0))
    return TokenLoader(PackedDataset(tokens, seq_len=SEQ_LEN), batch_size=batch_size, shuffle=True, seed=seed)


class TokenMeanLM(TrainModule):
    """Next-token loss averaged over the valid (label != -100) tokens of the micro-batch, reporting their
    count unless `report_tokens=False`; plain SGD, so every factor on the gradient shows in the update."""

    def __init__(self, lr: float = 0.5, report_tokens: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)
        self.lr, self.report_tokens = lr, report_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        loss = torch.nn.functional.cross_entropy(self(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "num_tokens": (labels != -100).sum()} if self.report_tokens else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TinyLM(TrainModule):
    """A byte-level embedding-and-head LM with dropout (the run depends on the RNG), on dict batches; AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(257, 16)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(16, 257)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.drop(self.emb(batch["input_ids"])))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def tiny_lm_loader() -> TokenLoader:
    """TinyLM's data: 124 shuffled blocks of 257-way tokens, 8 per batch."""
    return token_loader(8, vocab_size=257, n_tokens=2000, seed=3)


def uneven_token_data(n: int = 64, length: int = 12, by_parity: bool = False) -> TensorDataset:
    """(ids, labels) with -100 padding after 1..`length` valid labels per sample. `by_parity`: even samples
    hold 8..12 valid labels and odd ones 1..3, so the two ranks of a data-parallel sampler (even indices to
    rank 0, odd to rank 1) see about fourfold different token counts."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 16, (n, length), generator=g)
    labels = torch.randint(0, 16, (n, length), generator=g)
    if by_parity:
        many, few = torch.randint(8, length + 1, (n,), generator=g), torch.randint(1, 4, (n,), generator=g)
        valid = torch.where(torch.arange(n) % 2 == 0, many, few)
    else:
        valid = torch.randint(1, length + 1, (n,), generator=g)
    labels[torch.arange(length)[None, :] >= valid[:, None]] = -100
    return TensorDataset(ids, labels)


def read_metrics(root: Path, key: str = "train/loss") -> dict[int, float]:
    """step -> value of `key` from the always-on JSONL log."""
    out = {}
    for line in (Path(root) / "logs" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if key in row:
            out[row["step"]] = row[key]
    return out


def quiet(**overrides):
    """Trainer kwargs for tests: no progress bar, log every step."""
    return {"enable_progress_bar": False, "log_every_n_steps": 1, **overrides}


class StopAt(Callback):
    """Saves a checkpoint after optimizer step `step` and ends the fit there, as a preempted run would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_and_stop("test interruption")


def fit(module, loader, root: Path, steps: int, *, val_loader=None, ckpt_path=None, **kwargs) -> Trainer:
    """One seeded `Trainer.fit` of `steps` optimizer steps, logging every step; returns the Trainer."""
    trainer = Trainer(max_steps=steps, seed=kwargs.pop("seed", 0), default_root_dir=root, **quiet(**kwargs))
    trainer.fit(module, loader, val_loader, ckpt_path=ckpt_path)
    return trainer


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    """A detached copy of the module's parameters, in order."""
    return [p.detach().clone() for p in module.parameters()]


def assert_params_close(got, expected, atol: float = 1e-5) -> None:
    """Parameter lists (tensors or nested lists) equal within `atol`, naming the first that is not."""
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        diff = (torch.as_tensor(g) - torch.as_tensor(e)).abs().max().item()
        assert diff <= atol, f"parameter {i} differs by {diff:.2e} (tolerance {atol})"


def checkpoint_steps(root: Path) -> list[int]:
    """The steps of the `step-N` checkpoints under root/checkpoints, ascending."""
    return sorted(
        int(p.name.split("-")[1])
        for p in (Path(root) / "checkpoints").iterdir()
        if p.name.startswith("step-")
    )


def assert_validated(root: Path, step: int, with_loss: bool) -> None:
    """The run's checkpoint of `step` under root/checkpoints passed validation in the run that wrote it:
    checksums, reload under the run's own layout and, `with_loss` (a run with validation data), the reloaded
    model's loss equal to the live one's."""
    report = Path(root) / "checkpoints" / f"step-{step:08d}" / "validated.json"
    assert report.exists(), f"{root.name}: no validated checkpoint of step {step}"
    checked = json.loads(report.read_text())["checked"]
    expected = ["checksums", "reload", "loss"] if with_loss else ["checksums", "reload"]
    assert checked == expected, f"{root.name}: its step-{step} checkpoint was validated by {checked}"


class FakeClock:
    """A clock that moves only when the test moves it: what a test expects of time is exact, and does not
    depend on how fast or loaded this machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fake_time(monkeypatch, module: str, clock: FakeClock, *clocks: str) -> None:
    """Give `module` (e.g. "trainer.trainer") a `time` whose functions named in `clocks` read `clock`;
    the real `time` and every other module are untouched."""
    shim = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    for name in clocks:
        setattr(shim, name, clock)
    monkeypatch.setattr(importlib.import_module(module), "time", shim)


def launch_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, one torch thread per process, offline
    (Weights & Biases and the Hugging Face hub), plus `extra`."""
    return _launch_env(os.environ, extra)


# glibc's resolver options for every test process (unless the environment sets its own). Each TCPStore client
# connection names its peer with getnameinfo, and for the IPv4-mapped ::ffff:127.0.0.1 that c10d connects to,
# /etc/hosts has no entry: the name is asked of the DNS server. Where it drops a query (here, one in ~26),
# glibc asks again after its 5 s default timeout, and the job's ranks all wait for that one: after 1 s instead.
RESOLVER = {"RES_OPTIONS": "timeout:1"}


def _launch_env(environ: Mapping[str, str], extra: dict[str, str]) -> dict[str, str]:
    env = {**RESOLVER, **{k: v for k, v in environ.items() if k not in LAUNCHER_KEYS}}
    # PYTHONFAULTHANDLER: a rank that aborts or segfaults prints its threads' Python stacks (`failure`);
    # RUST_LOG: torchft's lighthouses and managers log every quorum at INFO otherwise (read as it imports)
    fixed = {
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "PYTHONFAULTHANDLER": "1",
        "RUST_LOG": "warn",
    }
    return {**env, **fixed, **extra}


# how a process's crash starts in its stderr: Python's fault handler, a C++ exception that ended the process
CRASH_MARKS = ("Fatal Python error", "terminate called", "what():")
CRASH_LINES = 40  # of each crash, as many lines as a fault handler's dump of a few threads' stacks
# lines kept before each crash: what the process said last (a script's "starting X"), where a native thread's
# fault leaves the Python stacks without the arguments that say which case it ran
CRASH_CONTEXT = 2


def failure(stderr: str, tail: int = 3000) -> str:
    """A failed job's stderr as its assertion shows it: how any process crashed (the CRASH_CONTEXT lines before
    and the first CRASH_LINES lines from each CRASH_MARKS line before the tail: the tracebacks of the ranks the
    crash took down push it out of the tail), then the last `tail` characters."""
    lines, crashes, until = stderr[:-tail].splitlines(), [], -1
    for i, line in enumerate(lines):
        if i > until and any(mark in line for mark in CRASH_MARKS):
            start, until = max(i - CRASH_CONTEXT, until + 1), i + CRASH_LINES - 1
            # (not the fault handler's list of the extension modules loaded, one line of thousands of characters)
            kept = [x for x in lines[start : until + 1] if not x.startswith("Extension modules:")]
            crashes += [*kept, "..."]
    return "\n".join([*crashes, stderr[-tail:]])


# the environment the session started with: the preloaded interpreter imports under it, not under what a
# test (monkeypatch) or a library in this process (torch, Lightning) set since
SESSION_ENV = _launch_env(dict(os.environ), {})


RANK_SLOTS = (
    "TRAINER_TEST_RANK_SLOTS"  # the lock file the pytest-xdist workers of one session share (conftest)
)
WIDE = 3  # a launch of this many processes or more runs alone: 4 and 8 ranks on 2 cores, ~1 GB each


@contextlib.contextmanager
def rank_slots(n: int) -> Iterator[None]:
    """Hold the cores for a launch of n processes while it runs. Under pytest-xdist (`make test`), launches of
    up to two processes share the machine (much of their time is a timeout, a restart or a start-up that
    leaves cores idle), a wider one waits until it has the machine to itself: two 4- or 8-rank jobs at once
    would thrash 2 cores and their memory. A launch of one process takes no slot: it loads the machine as
    much as a test that runs in its worker's own process, which runs beside anything (waiting, it left a
    core idle while the other worker's wide job slept on a timeout). Outside xdist nothing else runs beside a test, and this
    does nothing."""
    path = os.environ.get(RANK_SLOTS)
    if path is None or n <= 1:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if n >= WIDE else fcntl.LOCK_SH)
        yield  # closing the file releases the lock


def rank_command(
    n: int, script: Path, *args: str, torchrun: bool = False, max_restarts: int = 0
) -> list[str]:
    """The command that runs `script ARGS` on n ranks as a user starts it. Self-spawning (default): the script
    is given `--devices n` and its rank 0 starts the others, binding its store on a port the system picks.
    `torchrun`: an elastic `torchrun --standalone` job of n processes (its agent binds a port the same way)."""
    if not torchrun:
        return [sys.executable, str(script), "--devices", str(n), *args]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
        f"--max-restarts={max_restarts}", str(script), *args,
    ]  # fmt: skip


# a process a test started: forked from the preloaded interpreter, or a fresh one
Process = preloaded.PreloadedProcess | subprocess.Popen


def start_ranks(
    n: int,
    script: Path,
    *args: str,
    torchrun: bool = False,
    max_restarts: int = 0,
    env: dict | None = None,
    fresh: bool = False,
) -> Process:
    """`rank_command(...)` started in the background (stdout and stderr piped, as text), for a test that acts
    on the job while it runs (a signal); `run_ranks` waits for it instead. The launcher and its ranks (or
    torchrun's agent and its workers) are forks of the preloaded interpreter (`start_process`); `fresh`: fresh
    interpreters, as a user starts them."""
    cmd = rank_command(n, script, *args, torchrun=torchrun, max_restarts=max_restarts)
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env(**(env or {})))
    slots = rank_slots(n)
    slots.__enter__()
    try:
        proc = subprocess.Popen(cmd, **popen) if fresh else start_process(cmd, **popen)
    except BaseException:
        slots.__exit__(None, None, None)
        raise
    # the job keeps its slots until it has exited, however the test ends it (`wait` is thread-safe)
    threading.Thread(target=lambda: (proc.wait(), slots.__exit__(None, None, None)), daemon=True).start()
    return proc


def start_process(cmd: list[str], **popen: Any) -> Process:
    """subprocess.Popen(cmd, **popen), forked from the preloaded interpreter where it runs the same there
    (tests/preloaded.py `spawn`), as are the processes it starts as a launcher (torchrun, `trainer replicas`,
    trainer/core/launch.py)."""
    return preloaded.spawn(cmd, SESSION_ENV, **popen)


def run_ranks(
    n: int,
    script: Path,
    *args: str,
    torchrun: bool = False,
    max_restarts: int = 0,
    env: dict | None = None,
    timeout: float = 240,
    check: bool = True,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Run `script ARGS` on n gloo ranks (see `rank_command`) to its end, within `timeout` seconds; with
    `check`, a job that fails fails the test with the ranks' stderr (a failing rank's traceback is there).
    The ranks are forks of a preloaded interpreter (tests/preloaded.py) and a torchrun job the world torchrun
    starts (`torchrun_world`); one with restarts runs under torchrun's agent (itself a fork, as are its
    workers), and a `fresh` one is launched as a user does (fresh interpreters, torchrun itself)."""
    if fresh or (torchrun and max_restarts):
        return _run_launched(
            n,
            script,
            *args,
            torchrun=torchrun,
            max_restarts=max_restarts,
            env=env,
            timeout=timeout,
            check=check,
            fresh=fresh,
        )
    env = launch_env(**(env or {}))
    with rank_slots(n), contextlib.ExitStack() as stack:
        if torchrun:
            commands = torchrun_world(n, [str(script), *args], env, stack)
        else:
            commands = [(rank_command(n, script, *args), env)]
        return _run_job(commands, f"{script.name} on {n} ranks", timeout, check)


def _run_job(
    commands: list[tuple[list[str], dict[str, str]]], what: str, timeout: float, check: bool
) -> subprocess.CompletedProcess:
    """`run_commands` in this directory, a job past `timeout` (and with `check`, one that failed) failing the
    test with the end of its stderr; `what` names the job."""
    try:
        done = run_commands(commands, os.getcwd(), timeout)
    except subprocess.TimeoutExpired as late:
        raise AssertionError(f"{what} ran past {timeout}s:\n{failure(late.stderr, 4000)}") from None
    if check:
        assert done.returncode == 0, f"{what} exited {done.returncode}:\n{failure(done.stderr, 4000)}"
    return done


def _run_launched(
    n: int,
    script: Path,
    *args: str,
    torchrun: bool,
    max_restarts: int,
    env: dict | None,
    timeout: float,
    check: bool,
    fresh: bool,
) -> subprocess.CompletedProcess:
    proc = start_ranks(n, script, *args, torchrun=torchrun, max_restarts=max_restarts, env=env, fresh=fresh)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # as subprocess.run's timeout does; self-spawned ranks die with it (PR_SET_PDEATHSIG)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"{script.name} on {n} ranks ran past {timeout}s:\n{failure(stderr, 4000)}"
        ) from None
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        assert done.returncode == 0, (
            f"{script.name} on {n} ranks exited {done.returncode}:\n{failure(stderr, 4000)}"
        )
    return done


def torchrun_world(
    n: int, program: list[str], env: dict[str, str], stack: contextlib.ExitStack
) -> list[tuple[list[str], dict[str, str]]]:
    """The n commands `torchrun --standalone --nproc_per_node=n PROGRAM` runs, with the variables its agent
    gives them, and its store (hosted here for as long as `stack` is open: its ranks connect to it)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False)
    stack.callback(lambda: store)  # kept alive until the job has ended
    world = {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(n), "TORCHELASTIC_RUN_ID": uuid.uuid4().hex, "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
    }  # fmt: skip
    return [
        (
            [sys.executable, *program],
            {**env, **world, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)},
        )
        for r in range(n)
    ]


def run_commands(
    commands: list[tuple[list[str], dict[str, str]]], cwd: str, timeout: float
) -> subprocess.CompletedProcess:
    """Run (command, environment) pairs side by side as one job, forked from the preloaded interpreter where
    they run the same there (tests/preloaded.py), their stdout and stderr each in one stream as a launcher's;
    the first to fail ends the others, as torchrun does. Past `timeout` the job is killed and, as in
    subprocess.run, TimeoutExpired carries what it printed."""
    deadline = time.monotonic() + timeout
    with open(os.devnull) as null, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        fds = {0: null.fileno(), 1: out.fileno(), 2: err.fileno()}
        procs = [preloaded.popen(cmd, env, cwd, fds, SESSION_ENV) for cmd, env in commands]
        ended = {_ended_fd(p): p for p in procs}
        pidfds = [fd for fd, p in ended.items() if not isinstance(p, preloaded.PreloadedProcess)]
        code = 0
        while ended and (left := deadline - time.monotonic()) > 0:
            for fd in select.select(list(ended), [], [], left)[0]:
                proc = ended.pop(fd)
                if proc.wait() != 0 and code == 0:
                    code = proc.returncode
                    for other in procs:
                        other.kill()
        for proc in procs:
            proc.kill()
            proc.wait()
        for fd in pidfds:
            os.close(fd)
        out.seek(0), err.seek(0)
        stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
    if ended:
        raise subprocess.TimeoutExpired(commands[0][0], timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(commands[0][0], code, stdout, stderr)


def _ended_fd(proc: Process) -> int:
    """A descriptor that becomes readable when `proc` ends."""
    return proc.fileno() if isinstance(proc, preloaded.PreloadedProcess) else os.pidfd_open(proc.pid)


def join_world(rank: int, world: int, port: int, run_id: str = "test") -> None:
    """This process as rank `rank` of `world` under torchrun, whose store the test process hosts on `port`
    (as torchrun's agent does): the variables the Trainer's process group reads; one thread (2 cores)."""
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_USE_AGENT_STORE="true",
    )  # fmt: skip


def call_ranks(fn: Callable[..., None], n: int, *args: Any, timeout: float = 240) -> None:
    """`fn(rank, *args)` for rank 0..n-1 at once, as torch.multiprocessing.spawn runs them, each a fork of the
    preloaded interpreter (tests/scripts/call_rank.py) instead of a fresh one (~3 CPU-s of imports a rank);
    `fn` is a module-level function of a test module and `args` are JSON. A rank that raises fails the test
    with its traceback."""
    module = sys.modules[fn.__module__].__file__
    command = [sys.executable, str(SCRIPTS / "call_rank.py"), module, fn.__name__, json.dumps(args)]
    env = launch_env()
    with rank_slots(n):
        _run_job([([*command, str(r)], env) for r in range(n)], f"{fn.__name__} on {n} ranks", timeout, True)


def run_script(
    n: int, script: Path, tmp: Path, name: str, *args: str, timeout: float = 120, **launch
) -> tuple[subprocess.CompletedProcess, Path]:
    """One of the distributed training scripts on n ranks (`run_ranks(..., **launch)`), its run under
    tmp/name and rank 0's results in tmp/name.json (`script_result`); the job and the run root."""
    root, out = tmp / name, tmp / f"{name}.json"
    done = run_ranks(n, script, "--root", str(root), "--out", str(out), *args, timeout=timeout, **launch)
    return done, root


def run_world(
    n: int, script: Path, tmp: Path, runs: dict[str, list[str]], *common: str, timeout: float = 400
) -> None:
    """The runs of one of the distributed training scripts (name -> its arguments, plus `common`), one after
    another in one torchrun world of n processes (`dist_common.parse_runs`): each leaves what
    `run_script(n, script, tmp, name, ...)` would (its run under tmp/name, rank 0's results in tmp/name.json),
    and together they pay the start-up of one launch (seconds of CPU per process) instead of one each."""
    argv = [
        ["--root", str(tmp / name), "--out", str(tmp / f"{name}.json"), *args] for name, args in runs.items()
    ]
    run_ranks(n, script, "--runs", json.dumps(argv), *common, torchrun=True, timeout=timeout)


def script_result(tmp: Path, name: str) -> dict:
    """What rank 0 of `run_script(..., tmp, name, ...)` wrote."""
    return json.loads((tmp / f"{name}.json").read_text())


def launch_layouts(
    script: Path, tmp: Path, nproc: int, layouts: list[dict], steps: int, timeout: float = 400
) -> dict:
    """Run `script`'s layouts (Parallel3DStrategy kwargs with a "tag") one after another in one torchrun
    world of `nproc` processes; returns what its rank 0 wrote to --out (runs' logs are under tmp/runs)."""
    out = tmp / f"out-{nproc}.json"
    run_ranks(
        nproc, script, "--layouts", json.dumps(layouts), "--out", str(out), "--root", str(tmp / "runs"),
        "--steps", str(steps), torchrun=True, timeout=timeout,
    )  # fmt: skip
    return json.loads(out.read_text())


def reference_run(make_run, root: Path, steps: int, batch: int) -> tuple[dict, dict, dict, dict]:
    """The one-process run a multi-process layout is compared with: step losses, gradient norms, val
    losses and final weights of `make_run(root, steps, batch)`."""
    trainer, module, train, val = make_run(root, steps, batch)
    trainer.fit(module, train, val)
    weights = {n: p.detach() for n, p in module.named_parameters()}
    return read_metrics(root), read_metrics(root, "train/grad_norm"), read_metrics(root, "val/loss"), weights


def run_cli(
    *args: str, cwd: Path, timeout: float = 300, ranks: int = 1, **env: str
) -> subprocess.CompletedProcess:
    """`trainer ARGS` as a user runs it, in its own process, offline (TRAINER_CACHE: the test's tmp_path
    unless `env` names one); the caller checks its exit code and output. `ranks`: the processes it starts
    (`rank_slots`)."""
    cmd = [sys.executable, "-m", "trainer.cli", *args]
    with rank_slots(ranks):
        return run_commands([(cmd, launch_env(**env))], str(cwd), timeout)


def hand_f1(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """Macro F1 written out: per class 2PR / (P + R), averaged over the classes that occur."""
    scores = []
    for c in sorted(set(labels.tolist()) | set(predicted.tolist())):
        tp = ((predicted == c) & (labels == c)).sum().item()
        precision = tp / max((predicted == c).sum().item(), 1)
        recall = tp / max((labels == c).sum().item(), 1)
        scores.append(0.0 if tp == 0 else 2 * precision * recall / (precision + recall))
    return sum(scores) / len(scores)
