"""Peak memory and time of one forward + backward of a 1B-like Llama head's loss on the CPU: the plain
`F.cross_entropy(F.linear(h, W).float())` against the chunked fused loss of
trainer.models.linear_cross_entropy.

Each arm runs one step in a fresh process and reports how far its resident memory peaked above where it
was before the step (inputs and weights excluded, their gradients included) and its time; the arms
alternate for --rounds (so drift on a shared machine hits all of them) and each keeps its best time.
Ratios are against the plain loss.
Run: python bench/chunked_loss.py [--tokens 2048] [--chunks 512 2048] [--rounds 3] [--bf16]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.models.linear_cross_entropy import linear_cross_entropy

DIM, VOCAB = 2048, 128256  # Llama 3.2 1B's hidden width and vocabulary


def arm(name: str, tokens: int, bf16: bool) -> dict[str, float]:
    """One forward + backward in this process: {"peak_bytes": how far resident memory peaked above where it
    was, "seconds": its time}."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, DIM, generator=g).requires_grad_()
    weight = torch.empty(VOCAB, DIM).normal_(std=0.02, generator=g).requires_grad_()  # no temporary
    labels = torch.randint(0, VOCAB, (tokens,), generator=g)
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak (VmHWM) restarts from the current VmRSS
    before = _kib("VmRSS")
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if name == "plain":
            loss = F.cross_entropy(F.linear(hidden, weight).float(), labels)
        else:
            loss = linear_cross_entropy(hidden, weight, labels, int(name))
    loss.backward()
    seconds = time.perf_counter() - start
    return {"peak_bytes": (_kib("VmHWM") - before) * 1024, "seconds": seconds}


def _kib(field: str) -> int:
    """A memory field of /proc/self/status, in KiB."""
    return int(re.search(field + r":\s+(\d+)", Path("/proc/self/status").read_text())[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bf16", action="store_true", help="under bf16 autocast (the recipes' bf16-mixed)")
    p.add_argument("--arm", help=argparse.SUPPRESS)  # set in the child processes
    a = p.parse_args()
    if a.arm:
        print(json.dumps(arm(a.arm, a.tokens, a.bf16)))
        return
    common = ["--tokens", str(a.tokens), *(["--bf16"] if a.bf16 else [])]
    names = ["plain", *map(str, a.chunks)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for _ in range(a.rounds):
        for name in names:
            cmd = [sys.executable, __file__, "--arm", name, *common]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.splitlines()[-1]))
    best = {n: {k: min(r[k] for r in rs) for k in ("peak_bytes", "seconds")} for n, rs in runs.items()}
    logits_gb, precision = a.tokens * VOCAB * 4 / 1e9, "bf16 autocast" if a.bf16 else "fp32"
    print(f"head {DIM} x {VOCAB}, {a.tokens} tokens ({logits_gb:.2f} GB of fp32 logits), {precision}, "
          f"{torch.get_num_threads()} threads, best of {a.rounds} rounds")  # fmt: skip
    base = best["plain"]
    for name, r in best.items():
        label = "plain" if name == "plain" else f"chunks of {name}"
        peak, seconds = r["peak_bytes"], r["seconds"]
        print(f"{label:>16}: peak +{peak / 2**30:.2f} GiB ({peak / base['peak_bytes']:.2f}x), "
              f"{seconds:.2f} s ({seconds / base['seconds']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
