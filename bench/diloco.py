"""DiLoCo (`fault_tolerance.sync_every=k`) against per-step sync on the tiny Llama recipe: 2 replica groups
of one process under `trainer replicas`, the same steps and tokens in both arms; prints the validation loss
curve of each (validation right after a meeting: `--every` is a multiple of k) and the final ratio (target:
DiLoCo within 2% of per-step sync at k=8), and the cross-group all-reduces each arm made.

`python bench/diloco.py [--steps 320] [--every 40] [--k 8] [--sweep 0.7:0.9,1:0,...]` (one run of the recipe on
2 processes per arm: about 5 minutes each on this 2-core machine when nothing else runs)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE = Path(__file__).parents[1] / "recipes" / "llama_tiny.yaml"


def run_arm(
    root: Path, steps: int, every: int, k: int, outer: tuple[float, float] = (0.7, 0.9)
) -> dict[int, float]:
    """One `trainer replicas` run; replica 0's validation loss by step."""
    cmd = [
        sys.executable, "-m", "trainer.cli", "replicas", "--groups", "2", "--max-restarts", "0", str(RECIPE),
        f"trainer.max_steps={steps}", f"trainer.val_check_interval={every}", f"trainer.default_root_dir={root}",
        "trainer.enable_progress_bar=false", f"fault_tolerance.sync_every={k}",
        f"fault_tolerance.outer_lr={outer[0]}", f"fault_tolerance.outer_momentum={outer[1]}",
    ]  # fmt: skip
    # two processes on this machine: one thread each (torchrun sets no OMP_NUM_THREADS for one process per
    # group, and two processes of two threads on two cores spin against each other: 3-10 s a step)
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"diloco bench: `{' '.join(cmd)}` failed: {done.stderr.strip().splitlines()[-1:]}")
    rows = [
        json.loads(line) for line in (root / "replica_0" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    return {row["step"]: row["val/loss"] for row in rows if "val/loss" in row}


def outer_pairs(text: str) -> list[tuple[float, float]]:
    """`--sweep "0.7:0.9,1:0"`: the (outer lr, outer momentum) pairs to run."""
    try:
        pairs = [tuple(float(x) for x in item.split(":")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(pair) != 2 for pair in pairs):
        raise SystemExit(
            f"--sweep {text!r}; allowed: LR:MOMENTUM pairs separated by commas, e.g. 0.7:0.9,1:0"
        )
    return [(lr, momentum) for lr, momentum in pairs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=320)
    p.add_argument("--every", type=int, default=40)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--sweep", help="LR:MOMENTUM pairs (comma-separated): one DiLoCo arm each, in place of "
                   "--outer-lr/--outer-momentum; per-step sync runs once")  # fmt: skip
    args = p.parse_args()
    if args.every % args.k or args.steps % args.every:
        raise SystemExit(
            f"--every {args.every} must be a multiple of --k {args.k} and divide --steps {args.steps}"
        )
    pairs = outer_pairs(args.sweep) if args.sweep else [(args.outer_lr, args.outer_momentum)]
    with tempfile.TemporaryDirectory() as tmp:
        per_step = run_arm(Path(tmp) / "per_step", args.steps, args.every, 1)
        arms = [
            run_arm(Path(tmp) / f"diloco_{i}", args.steps, args.every, args.k, pair)
            for i, pair in enumerate(pairs)
        ]
    print(
        f"tiny Llama, 2 replica groups, {args.steps} steps: validation loss (ratio: DiLoCo / per-step sync)"
    )
    names = [f"k={args.k} {lr:g}/{momentum:g}" for lr, momentum in pairs]
    print(f"{'step':>6} {'per-step sync':>14}" + "".join(f" {name:>16} {'ratio':>7}" for name in names))
    for step in sorted(per_step):
        losses = [arm.get(step, float("nan")) for arm in arms]
        print(
            f"{step:>6} {per_step[step]:>14.4f}"
            + "".join(f" {loss:>16.4f} {loss / per_step[step]:>7.4f}" for loss in losses)
        )
    last = max(per_step)
    print(
        f"final (outer SGD lr/Nesterov momentum; target DiLoCo/per-step <= 1.02), per-step sync {per_step[last]:.4f}:"
    )
    for (lr, momentum), arm in zip(pairs, arms, strict=True):
        ratio = arm[last] / per_step[last]
        print(
            f"  outer lr {lr:g}, momentum {momentum:g}: {arm[last]:.4f} = {ratio:.4f}x {'PASS' if ratio <= 1.02 else 'FAIL'}"
        )
    print(f"cross-group all-reduces: per-step {args.steps}, DiLoCo {args.steps // args.k}")


if __name__ == "__main__":
    main()
