"""Tokens/s, MFU and peak memory of one Llama shape trained four ways on one GPU, side by side (issue #12):

  hf-lightning   Hugging Face `LlamaForCausalLM` (sdpa attention) under PyTorch Lightning
  hf-loop        the same HF model in a plain PyTorch loop
  trainer-eager  this project's `CausalLM` under its `Trainer`, defaults only (which on CUDA include fused
                 AdamW: the Trainer picks it when the optimizer does not say)
  trainer-speed  the same with every speed option: per-block torch.compile, the chunked linear +
                 cross-entropy (`loss_chunk_tokens`: the B x T x vocab fp32 logits never exist), fused AdamW;
                 activation checkpointing off (memory is not the limit for this shape on an H200)

Every arm runs in its own fresh process of this script (peak memory and compile caches stay apart) on the
same random tokens (seed 0) and init std (0.02; ours also scales wo and w2 down by depth), bf16 autocast
over fp32 weights, AdamW(lr 3e-4, betas (0.9, 0.95), weight decay 0.1) and gradient clipping at 1.0. An
arm's tokens/s is micro-batch x seq_len over its median step time after `--warmup` steps (the device
synchronised before every timestamp); MFU is one formula for all arms, tokens/s x `Llama.flops_per_token(seq_len)` (PaLM:
6 N_matmul + 12 L H Q T) / `--peak-tflops`; peak memory is `torch.cuda.max_memory_allocated()` (on the
CPU: the arm process's peak RSS). Each arm's line also shows its first and last loss, which should agree
across arms. An arm that crashes (an OOM, say) gets its error in its row, its last lines on stderr, and
the others still run; the exit status is 1 then, else 0.

The last line checks issue #12's acceptance on an H200, as PASS/FAIL, informative only: trainer-speed at
>= 1.35x the tokens/s of hf-lightning (>= 54,000 tokens/s, >= 45% MFU), peak memory no higher than
hf-lightning's.

On one GPU, the 1b shape (16 layers, dim 2048, GQA 32/8, vocab 128,256, tied; seq 2048, micro-batch 4;
5 warm-up + 25 timed steps per arm; estimated at 2-4 minutes on an H200, the blocks' torch.compile
included). `--log-dir` keeps each arm's whole output (compile reports, warnings):

    PYTHONPATH=. python bench/gpu_throughput.py --log-dir gpu_throughput_logs
    PYTHONPATH=. python bench/gpu_throughput.py --arms hf-lightning,trainer-speed --steps 40

On the CPU, a smoke run of every arm on the tiny preset, tied like 1b (tests/observability/test_gpu_bench.py runs it):

    PYTHONPATH=. python bench/gpu_throughput.py --shape tiny --device cpu --steps 3 --warmup 1

Needs transformers and Lightning (`lightning.pytorch` or `pytorch_lightning`); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from callbacks import Callback
from strategies.techniques.compile_blocks import MODES
from trainer import Trainer
from trainer.models.causal_lm import CausalLM
from trainer.models.hf_llama import to_hf_config
from trainer.models.llama import Llama, LlamaConfig


@dataclass(frozen=True)
class Shape:
    """A Llama preset (with some fields overridden) and the micro-batch it trains on."""

    preset: str
    seq_len: int
    micro_batch: int
    overrides: dict[str, Any] = field(default_factory=dict)

    def config(self) -> LlamaConfig:
        return LlamaConfig.preset(self.preset, **self.overrides)


SHAPES = {
    "1b": Shape("1b", seq_len=2048, micro_batch=4),
    # the CPU smoke shape: tied like 1b, so that the tied head takes the same paths in every arm; short
    # sequences because a CPU without AVX-512 BF16 runs bf16 matmuls ~25x slower than fp32 (1.8 s a step at 128)
    "tiny": Shape("tiny", seq_len=32, micro_batch=2, overrides={"tie_embeddings": True}),
}
ARMS = ("hf-lightning", "hf-loop", "trainer-eager", "trainer-speed")
BASELINE, CONTENDER = "hf-lightning", "trainer-speed"
LR, BETAS, WEIGHT_DECAY, CLIP = 3e-4, (0.9, 0.95), 0.1, 1.0
TARGET_RATIO, TARGET_TOKENS_PER_S, TARGET_MFU = 1.35, 54_000, 0.45  # issue #12, for the 1b shape on an H200
GIB = 2**30


# ---- what every arm shares ------------------------------------------------------------------------------
class StepClock:
    """Timestamps at the end of each optimizer step, the device synchronised first so that a stamp
    means the step's kernels have finished, not only been queued; and each step's loss, read after the
    stamp (the device is idle then, so the read costs the next step only a tiny copy)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []
        self.losses: list[float] = []

    def stamp(self, loss: torch.Tensor | float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        self.losses.append(float(loss))

    def durations(self, warmup: int) -> list[float]:
        """Seconds of each step after the first `warmup` (step k lasts from stamp k-1 to stamp k)."""
        durations = [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)][warmup - 1 :]
        if not durations:
            raise RuntimeError(f"{len(self.stamps)} steps were timed; {warmup + 1} or more are needed")
        return durations


def random_token_loader(config: LlamaConfig, shape: Shape, steps: int) -> DataLoader:
    """`steps` micro-batches of random tokens (seed 0) as {"input_ids", "labels"}: labels are the
    inputs shifted by one, the batches CausalLM trains on (the HF arms shift the inputs themselves)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        config.vocab_size, (steps * shape.micro_batch, shape.seq_len + 1), generator=generator
    )
    samples = [{"input_ids": row[:-1], "labels": row[1:]} for row in tokens]
    return DataLoader(samples, batch_size=shape.micro_batch, pin_memory=torch.cuda.is_available())


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.AdamW:
    """The HF arms' optimizer: torch's AdamW with its defaults (foreach on CUDA), as a user writes it."""
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)


def hf_llama(config: LlamaConfig, device: torch.device) -> nn.Module:
    """A randomly initialised `transformers.LlamaForCausalLM` of our config's shape and init scale, fp32
    weights on `device`, sdpa attention, no KV cache (training)."""
    from transformers import LlamaForCausalLM

    hf_config = to_hf_config(config)
    hf_config._attn_implementation = "sdpa"
    hf_config.use_cache = False
    with torch.device(device):
        model = LlamaForCausalLM(hf_config)
    return model.to(torch.float32)


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF's own causal-LM loss: it shifts the labels, so they are the inputs."""
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def lightning() -> Any:
    """`lightning.pytorch`, or the older standalone `pytorch_lightning` (the same API)."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl


# ---- the arms: each trains on `loader` and stamps `clock` after every step -------------------------------
def run_hf_lightning(
    config: LlamaConfig, loader: DataLoader, clock: StepClock, args: argparse.Namespace
) -> None:
    pl = lightning()

    class HFModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = hf_llama(config, clock.device)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return hf_loss(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return adamw(self.parameters())

    class Clock(pl.Callback):
        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            clock.stamp(outputs["loss"])

    trainer = pl.Trainer(
        accelerator="gpu" if clock.device.type == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed",
        gradient_clip_val=CLIP,
        max_steps=len(loader),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    trainer.fit(HFModule(), loader)


def run_hf_loop(config: LlamaConfig, loader: DataLoader, clock: StepClock, args: argparse.Namespace) -> None:
    model = hf_llama(config, clock.device)
    model.train()
    optimizer = adamw(model.parameters())
    for batch in loader:
        batch = {k: v.to(clock.device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(clock.device.type, dtype=torch.bfloat16):
            loss = hf_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.stamp(loss.detach())


def fit_trainer(module: CausalLM, loader: DataLoader, clock: StepClock, **speed_options: Any) -> None:
    """This project's Trainer on one device, nothing but the step: no checkpoints, loggers or bar."""

    class Clock(Callback):
        def on_train_batch_end(
            self, trainer: Trainer, module: Any, outputs: dict[str, Any], batch: Any, batch_idx: int
        ) -> None:
            clock.stamp(outputs["loss"])

    with tempfile.TemporaryDirectory() as root:  # the always-on JSONL metrics file goes here
        trainer = Trainer(
            accelerator=clock.device.type,
            devices=1,
            precision="bf16-mixed",
            gradient_clip_val=CLIP,
            max_steps=len(loader),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Clock()],
            default_root_dir=root,
            **speed_options,
        )
        trainer.fit(module, loader)


def run_trainer_eager(
    config: LlamaConfig, loader: DataLoader, clock: StepClock, args: argparse.Namespace
) -> None:
    fit_trainer(CausalLM(config, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY), loader, clock)


def run_trainer_speed(
    config: LlamaConfig, loader: DataLoader, clock: StepClock, args: argparse.Namespace
) -> None:
    module = CausalLM(
        config, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, loss_chunk_tokens=args.loss_chunk_tokens
    )
    compile_mode = True if args.compile_mode == "default" else args.compile_mode
    fit_trainer(module, loader, clock, compile=compile_mode, activation_checkpointing=None)


RUNNERS: dict[str, Callable[[LlamaConfig, DataLoader, StepClock, argparse.Namespace], None]] = {
    "hf-lightning": run_hf_lightning,
    "hf-loop": run_hf_loop,
    "trainer-eager": run_trainer_eager,
    "trainer-speed": run_trainer_speed,
}


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train `arm` for warmup + steps steps in this process; its timed steps' seconds, every step's loss
    and its peak memory in bytes."""
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    config = shape.config()
    if device.type == "cuda":
        torch.cuda.init()  # the allocator's statistics exist only once CUDA is initialised
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    clock = StepClock(device)
    RUNNERS[arm](config, random_token_loader(config, shape, args.warmup + args.steps), clock, args)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"step_s": clock.durations(args.warmup), "losses": clock.losses, "peak_bytes": peak}


# ---- the parent: one subprocess per arm, then the table -------------------------------------------------
@dataclass
class ArmResult:
    """An arm's measurements, or the one-line error it ended with."""

    arm: str
    step_s: list[float] = field(default_factory=list)  # the timed steps' seconds
    losses: list[float] = field(default_factory=list)  # every step's, the same data in every arm
    peak_bytes: float = 0.0
    error: str | None = None


def spawn_arm(arm: str, args: argparse.Namespace) -> ArmResult:
    """Run `arm` in a fresh process of this script. Its output goes to `--log-dir`/ARM.log when given, and
    its last lines to stderr when it fails; a crash or timeout becomes the result's one-line error."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        command = [sys.executable, __file__, *sys.argv[1:], "--child", arm, "--result", str(result_path)]
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            output, _ = child.communicate(timeout=args.arm_timeout)
            error = None if child.returncode == 0 else last_line(output) or f"exit status {child.returncode}"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
                os.killpg(child.pid, signal.SIGKILL)  # its own session: inductor's compile workers go too
            output, _ = child.communicate()
            error = f"timed out after {args.arm_timeout:.0f} s"
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.log_dir) / f"{arm}.log").write_text(output)
        if error is not None:
            tail = "\n".join(output.splitlines()[-40:]) or "(no output)"
            print(f"---- {arm} failed; its last lines:\n{tail}\n----", file=sys.stderr, flush=True)
            return ArmResult(arm, error=error)
        return ArmResult(arm, **json.loads(result_path.read_text()))


def last_line(output: str) -> str:
    """The last non-blank line of a child's output (a traceback's exception), cut to fit a table row."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


@dataclass(frozen=True)
class Yardstick:
    """What turns step times into the table's numbers, the same for every arm: tokens per step, FLOPs per
    token (`Llama.flops_per_token`, PaLM's 6 N_matmul + 12 L H Q T) and the device's peak (None: no MFU)."""

    shape: Shape
    flops_per_token: float
    peak_flops: float | None

    def tokens_per_s(self, result: ArmResult) -> float:
        """Tokens of one step over the median timed step's seconds."""
        return self.shape.micro_batch * self.shape.seq_len / statistics.median(result.step_s)

    def mfu(self, result: ArmResult) -> float | None:
        return self.tokens_per_s(result) * self.flops_per_token / self.peak_flops if self.peak_flops else None


def yardstick(args: argparse.Namespace) -> Yardstick:
    shape = SHAPES[args.shape]
    with torch.device("meta"):  # the formula reads only the config: nothing is allocated
        flops_per_token = Llama(shape.config()).flops_per_token(shape.seq_len)
    peak = args.peak_tflops * 1e12 if args.device == "cuda" else None
    return Yardstick(shape, flops_per_token, peak)


def print_environment(args: argparse.Namespace, stick: Yardstick) -> None:
    device = torch.device(args.device)
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        where = f"CPU, {os.cpu_count()} cores; torch {torch.__version__}"
    versions = ", ".join(
        f"{name} {version_of(name)}" for name in ("transformers", "lightning", "pytorch-lightning")
    )
    print(f"{where}; {versions}")
    config, shape = stick.shape.config(), stick.shape
    print(
        f"shape {args.shape}: {config.n_layers} layers, dim {config.dim}, heads {config.n_heads}/{config.n_kv_heads}, "
        f"vocab {config.vocab_size:,}, tied {config.tie_embeddings}; seq {shape.seq_len} x micro-batch "
        f"{shape.micro_batch}; bf16 autocast over fp32 weights; {args.warmup} warm-up + {args.steps} timed steps"
    )
    peak = f"MFU against {args.peak_tflops:.0f} TFLOP/s" if stick.peak_flops else "no MFU on the CPU"
    memory = "max_memory_allocated" if device.type == "cuda" else "the arm process's peak RSS"
    print(
        f"{stick.flops_per_token / 1e9:.2f} GFLOP/token (6 N_matmul + 12 L H Q T); {peak}; memory: {memory}"
    )


def version_of(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def progress_line(result: ArmResult, seconds: float) -> str:
    """An arm's wall time, the spread of its timed steps (a noisy run shows here) and its first and last
    loss (every arm trains the same data from the same init scale: they should start alike)."""
    if result.error is not None:
        return f"{result.arm}: failed after {seconds:.0f} s"
    steps = result.step_s
    return (
        f"{result.arm}: {seconds:.0f} s in all; timed steps median {statistics.median(steps):.3f} s, "
        f"min {min(steps):.3f}, max {max(steps):.3f}; loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}"
    )


def print_table(results: list[ArmResult], stick: Yardstick) -> None:
    base = next((r for r in results if r.arm == BASELINE and r.error is None), None)
    print(f"\n{'arm':<15}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}{'vs ' + BASELINE:>17}")
    for r in results:
        if r.error is not None:
            print(f"{r.arm:<15}  error: {r.error}")
            continue
        tokens, mfu = stick.tokens_per_s(r), stick.mfu(r)
        ratio = f"{tokens / stick.tokens_per_s(base):.2f}x" if base else "-"
        mfu_text = f"{mfu:.1%}" if mfu is not None else "-"
        print(f"{r.arm:<15}{tokens:>12,.0f}{mfu_text:>8}{r.peak_bytes / GIB:>10.2f}{ratio:>17}")


def acceptance(results: list[ArmResult], stick: Yardstick) -> str:
    """Issue #12's criterion as one line of PASS/FAIL checks (tokens/s and MFU targets on a GPU only)."""
    ok = {r.arm: r for r in results if r.error is None}
    if BASELINE not in ok or CONTENDER not in ok:
        return f"acceptance: not checked ({BASELINE} and {CONTENDER} must both have run)"
    base, speed = ok[BASELINE], ok[CONTENDER]
    tokens, mfu = stick.tokens_per_s(speed), stick.mfu(speed)
    ratio = tokens / stick.tokens_per_s(base)
    checks = [
        (f"{CONTENDER}/{BASELINE} {ratio:.2f}x >= {TARGET_RATIO}x", ratio >= TARGET_RATIO),
        (
            f"peak {speed.peak_bytes / GIB:.2f} <= {base.peak_bytes / GIB:.2f} GiB",
            speed.peak_bytes <= base.peak_bytes,
        ),
    ]
    if mfu is not None:
        checks.append((f"{tokens:,.0f} >= {TARGET_TOKENS_PER_S:,} tokens/s", tokens >= TARGET_TOKENS_PER_S))
        checks.append((f"MFU {mfu:.1%} >= {TARGET_MFU:.0%}", mfu >= TARGET_MFU))
    verdict = "PASS" if all(passed for _, passed in checks) else "FAIL"
    details = "; ".join(f"{text} {'PASS' if passed else 'FAIL'}" for text, passed in checks)
    return f"acceptance: {verdict} ({details})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="the first GPU, or the CPU",
    )
    parser.add_argument("--steps", type=int, default=25, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (at least 1)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200: 989)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=1024, help="trainer-speed's loss chunk")
    parser.add_argument(
        "--compile-mode", choices=MODES, default="default", help="trainer-speed's torch.compile"
    )
    parser.add_argument("--arm-timeout", type=float, default=240.0, help="seconds before an arm is killed")
    parser.add_argument("--log-dir", help="write each arm's whole output to LOG_DIR/ARM.log")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = [arm for arm in args.arms if arm not in ARMS]
    if unknown:
        parser.error(f"--arms has {', '.join(unknown)}; allowed: {', '.join(ARMS)}")
    if args.warmup < 1 or args.steps < 1:
        parser.error(f"--warmup={args.warmup} --steps={args.steps}; allowed: both at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device=cuda but torch sees no CUDA GPU; allowed here: cpu")
    return args


def main() -> int:
    args = parse_args()
    if args.child:
        Path(args.result).write_text(json.dumps(run_arm(args.child, args)))
        return 0
    stick = yardstick(args)
    print_environment(args, stick)
    results, started = [], time.perf_counter()
    for arm in args.arms:
        arm_started = time.perf_counter()
        results.append(spawn_arm(arm, args))
        print(progress_line(results[-1], time.perf_counter() - arm_started), flush=True)
    print(f"all arms: {time.perf_counter() - started:.0f} s")
    print_table(results, stick)
    print(acceptance(results, stick))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
