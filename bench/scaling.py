"""Data-parallel scaling of the tiny Llama recipe: tokens/s with 1 and 2 processes (DDP over gloo, one
thread per process), in the same invocation. Each process keeps its micro-batch (8 x 256 tokens), so
ideal scaling doubles tokens/s; efficiency = tokens/s(2) / (2 x tokens/s(1)).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE = Path(__file__).parents[1] / "recipes" / "llama_tiny.yaml"
STEPS = 40


def tokens_per_second(devices: int, root: Path) -> float:
    """Median global tokens/s over the logged steps after the first (start-up excluded)."""
    cmd = [
        sys.executable,
        "-m",
        "trainer.cli",
        "fit",
        str(RECIPE),
        f"trainer.devices={devices}",
        f"trainer.max_steps={STEPS}",
        "trainer.warmup_steps=2",
        "trainer.log_every_n_steps=5",
        "trainer.val_check_interval=1000",
        "trainer.val_at_start=false",
        "trainer.enable_progress_bar=false",
        "trainer.enable_checkpointing=false",
        "callbacks=[]",
        f"trainer.default_root_dir={root}",
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    rows = [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(
        r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r and r["step"] > 5
    )


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        one = tokens_per_second(1, Path(tmp) / "one")
        two = tokens_per_second(2, Path(tmp) / "two")
    print(f"tiny Llama, 8 x 256 tokens per process per step, 1 thread per process, {os.cpu_count()} cores")
    print(f"  1 process : {one:8.0f} tokens/s")
    print(f"  2 processes (ddp): {two:8.0f} tokens/s")
    print(f"  speed-up {two / one:.2f}x, scaling efficiency {two / (2 * one):.2f}")
