"""GPU smoke: the tiny and the 1B recipe, 30 steps each on one GPU, through the path `trainer fit` takes
(`load_recipe` + `build_run`), against a hand-written loop on the same model and batches, same invocation.

Prints the device each run trained on (and stops if it is not a GPU: issue #10's bug was a recipe saying
`accelerator: cuda` that trained on the CPU at 52 s/step), tokens/s and MFU after warm-up (the
ThroughputMonitor's windows after the first), and the ratio Trainer / hand loop (target >= 0.97).
Overrides keep each run near a minute: 30 steps, no validation, no checkpoints, JSONL only, and the 1B
recipe accumulates 4 micro-batches instead of 16. About 3 minutes on one H200. Not part of `make bench`.
"""

from __future__ import annotations

import gc
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from callbacks.mfu import peak_flops
from trainer.config import build_run, load_recipe
from trainer.core.schedules import LRSchedule, build_scheduler
from trainer.models.causal_lm import CausalLM
from trainer.models.llama import Llama

RECIPES = Path(__file__).parents[1] / "recipes"
STEPS, LOG_EVERY, WARMUP_LR = 30, 10, 5
HAND_STEPS, HAND_SKIP = 10, 3  # the hand loop's timed steps follow HAND_SKIP warm-up steps
COMMON = [
    f"trainer.max_steps={STEPS}",
    f"trainer.warmup_steps={WARMUP_LR}",
    f"trainer.log_every_n_steps={LOG_EVERY}",
    "trainer.devices=1",
    "trainer.enable_checkpointing=false",
    "trainer.enable_progress_bar=false",
    "callbacks=[callbacks.ThroughputMonitor]",
    "loggers=[]",
]
RUNS = {  # the tiny recipe says accelerator auto, the 1B recipe cuda: both must land on the GPU
    "llama_tiny.yaml": [],
    "llama_1b.yaml": ["trainer.accumulate_grad_batches=4"],
}


def forever(loader: Any) -> Any:
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def hand_tokens_per_s(
    module: CausalLM, loader: Any, trainer_args: dict[str, Any], device: torch.device
) -> float:
    """Tokens/s of a plain PyTorch loop doing the recipe's step: same model, batches, AdamW grouping,
    autocast, accumulation, clipping and schedule; timed between CUDA syncs after the warm-up steps."""
    with torch.device(device):
        model = Llama(module.config)
    hyper = {"lr": module.lr, "betas": module.betas, "weight_decay": module.weight_decay, "eps": module.eps}
    opt = CausalLM(model, **hyper).configure_optimizers()  # its AdamW grouping, as the Trainer run has
    sched = build_scheduler(opt, LRSchedule("cosine", WARMUP_LR, STEPS))
    accumulate = trainer_args["accumulate_grad_batches"]
    autocast = trainer_args["precision"] == "bf16-mixed"
    batches, tokens, start = forever(loader), 0, 0.0
    for step in range(HAND_SKIP + HAND_STEPS):
        if step == HAND_SKIP:
            torch.cuda.synchronize()
            start, tokens = time.perf_counter(), 0
        for batch in itertools.islice(batches, accumulate):
            ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            (loss / accumulate).backward()
            tokens += labels.numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_args["gradient_clip_val"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def trainer_rates(root: Path) -> tuple[float, float | None]:
    """Mean tokens/s per device and MFU of the ThroughputMonitor's windows after the first (warm-up)."""
    rows = [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in rows if "throughput/tokens_per_s_per_device" in r][1:]
    tokens = sum(r["throughput/tokens_per_s_per_device"] for r in windows) / len(windows)
    mfus = [r["throughput/mfu"] for r in windows if "throughput/mfu" in r]
    return tokens, (sum(mfus) / len(mfus) if mfus else None)


def run(recipe: str, overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = load_recipe(RECIPES / recipe, [*COMMON, *overrides, f"trainer.default_root_dir={root}"])
        trainer, module, train_loader, _ = build_run(config)
        device = trainer.strategy.root_device
        if device.type != "cuda":
            sys.exit(f"gpu_smoke: {recipe} resolved to device {device}; allowed: a CUDA device")
        args, data = config["trainer"], config["data"]
        hand = hand_tokens_per_s(module, train_loader, args, device)
        gc.collect()
        torch.cuda.empty_cache()
        trainer.fit(module, train_loader)  # no val loader: throughput only
        trained_on = {p.device for p in module.parameters()}
        if trained_on != {device}:
            sys.exit(f"gpu_smoke: {recipe} trained on {sorted(map(str, trained_on))}; allowed: {device} only")
        tokens, mfu = trainer_rates(root)
        flops = module.flops_per_token(data["seq_len"])
        peak = peak_flops(device)
        cfg = module.config
        print(
            f"{recipe}: Llama {cfg.dim}x{cfg.n_layers}, {data['batch_size']} x {data['seq_len']} tokens x "
            f"{args['accumulate_grad_batches']} micro-batches/step, precision {args['precision']}, "
            f"{STEPS} steps on {device}"
        )
        hand_mfu = f"  MFU {hand * flops / peak:6.1%}" if peak else ""
        print(f"  hand-written loop: {hand:10.0f} tokens/s{hand_mfu}")
        print(
            f"  Trainer (recipe):  {tokens:10.0f} tokens/s" + (f"  MFU {mfu:6.1%}" if mfu is not None else "")
        )
        print(f"  ratio Trainer/hand: {tokens / hand:.3f}  (target >= 0.97)")
        del trainer, module
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("gpu_smoke: needs a CUDA GPU and this machine has none; run it on one GPU")
    name = torch.cuda.get_device_name()
    peak = peak_flops(torch.device("cuda", 0))
    print(
        f"{name}, torch {torch.__version__}, dense BF16 peak "
        + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown")
    )
    for recipe, overrides in RUNS.items():
        run(recipe, overrides)
