"""DP-SGD's cost: step time and peak memory of private training (per-sample gradients by layer rules,
"hooks", and ghost clipping, "ghost") against plain training of the same tiny Llama on the same batch.

Each mode runs in a child process of this invocation. Memory is what training adds on top of the model
and data: the peak over the fit minus the level before it (`torch.cuda.max_memory_allocated` on a GPU;
on the CPU the process's peak RSS minus its RSS before `fit`). The ratios to plain training are printed.
`python bench/dpsgd.py [--batch 64]`."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from common import StepClock  # noqa: E402

from trainer import Trainer, TrainModule  # noqa: E402
from trainer.models.llama import Llama, LlamaConfig  # noqa: E402

STEPS, SEQ = 12, 64
CONFIG = LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)


class LM(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Llama(CONFIG)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(mode: str, batch: int) -> dict[str, float]:
    from strategies.dp_sgd import DPSGDStrategy

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (batch * STEPS, SEQ + 1))
    strategy = "auto"
    if mode != "plain":  # the same batch every step: no sampling, so the work per step is equal
        strategy = DPSGDStrategy(
            noise_multiplier=1.0, poisson_sampling=False, grad_sample_mode=mode, noise_seed=0
        )
    device = "gpu" if torch.cuda.is_available() else "cpu"
    clock = StepClock()
    module = LM()
    before = _rss_mib() if not torch.cuda.is_available() else 0.0
    with tempfile.TemporaryDirectory() as root:
        Trainer(
            strategy=strategy, accelerator=device, max_steps=STEPS, enable_progress_bar=False,
            enable_checkpointing=False, callbacks=[clock], default_root_dir=root, log_every_n_steps=STEPS,
        ).fit(module, DataLoader(TensorDataset(tokens), batch_size=batch))  # fmt: skip
    step = statistics.median(b - a for a, b in zip(clock.stamps[2:], clock.stamps[3:], strict=False))
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    return {"step_s": step, "peak_mib": peak}


def _rss_mib() -> float:
    """This process's resident memory now (Linux /proc), in MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mode", choices=("plain", "hooks", "ghost"))
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run(args.mode, args.batch)))
        return
    results = {}
    for mode in ("plain", "hooks", "ghost"):
        out = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--batch", str(args.batch)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["plain"]
    print(f"tiny Llama ({CONFIG.dim}-wide, {CONFIG.n_layers} layers), batch {args.batch} x {SEQ} tokens:")
    for mode, r in results.items():
        print(
            f"  {mode:5s}: {r['step_s'] * 1e3:7.1f} ms/step ({r['step_s'] / base['step_s']:.2f}x plain), "
            f"training memory {r['peak_mib']:.0f} MiB ({r['peak_mib'] / base['peak_mib']:.2f}x plain)"
        )


if __name__ == "__main__":
    main()
