"""How well the step-time model (strategies/plan/step_time.py) predicts measured speed: the tiny Llama on
gloo in the layouts 1 process, DDP 2, FSDP 2, tp 2 and pp 2, each trained through `trainer fit` with the
same global batch, against the model's tokens/s from the rates `trainer doctor --devices 2 --out F`
measured in the same invocation (or `--rates FILE`). Printed side by side: the raw prediction (the doctor's
matmul rate and busbw only) and one calibrated on the single-process run (the model's compute rate scaled
so that one row matches: a small model's GEMMs, its elementwise work and Python run below a large matmul's
rate), the error of each, and whether the ranking by predicted speed is the measured one: as a whole (median
rounds) and pair by pair, on the pairs the rounds decide (one layout faster in every round).

The layouts run in rounds, each round in a rotated order, and each layout's number is its median round:
on a host whose speed drifts over minutes (by up to 25% between rounds on a 2-vCPU VM), the best round
is a lucky moment, and calibrating on one layout's lucky moment shifts every other error by its luck; the
median of 3 or more rounds is steady (the load average is printed with each round). `--keep-rates F`
keeps the doctor's rates file.

    python bench/plan_accuracy.py [--rates rates.json] [--steps 20] [--rounds 3] [--keep-rates F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from strategies.plan.hardware import Rates, measured_hardware  # noqa: E402
from strategies.plan.shapes import Layout, RunShape  # noqa: E402
from strategies.plan.step_time import step_time  # noqa: E402
from trainer.config import load_recipe  # noqa: E402
from trainer.config.plan_inputs import layout_overrides, override_args, plan_inputs  # noqa: E402

RECIPE = REPO / "recipes" / "llama_tiny.yaml"
BASE = ["model.vocab_size=258", "data.global_batch_size=16"]  # 257 (bytes + end) rounded up for tp=2
SEQ, GLOBAL = 256, 16  # 16 sequences of 256 per optimizer step in every layout
# (name, processes, layout, the run: micro-batch and accumulation)
LAYOUTS = [
    ("1 process", 1, Layout(precision="fp32"), RunShape(8, SEQ, accumulation=2)),
    ("ddp 2", 2, Layout(dp_replicate=2, precision="fp32"), RunShape(8, SEQ)),
    ("fsdp 2", 2, Layout(dp_shard=2, zero_stage=3, precision="fp32"), RunShape(8, SEQ)),
    ("tp 2", 2, Layout(tp=2, sequence_parallel=True, precision="fp32"), RunShape(8, SEQ, accumulation=2)),
    ("pp 2", 2, Layout(pp=2, pp_microbatches=2, precision="fp32"), RunShape(16, SEQ)),
]


def doctor_rates(out: Path) -> Path:
    """`trainer doctor --devices 2 --out OUT`: the rates of this machine's gloo processes."""
    cmd = [sys.executable, "-m", "trainer.cli", "doctor", "--devices", "2", "--out", str(out)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=out.parent)
    if done.returncode != 0:
        raise SystemExit(
            f"trainer doctor failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
        )
    return out


def measured_tokens_per_s(
    name: str, processes: int, layout: Layout, run: RunShape, root: Path, steps: int
) -> float:
    """Median global tokens/s of `trainer fit` in `layout` over the logged steps after the first five."""
    config = load_recipe(RECIPE, BASE)
    overrides = [
        shlex.split(a)[0] for a in override_args(config, layout_overrides(config, layout, run, GLOBAL))
    ]
    cmd = [
        sys.executable, "-m", "trainer.cli", "fit", str(RECIPE), *BASE, *overrides,
        f"trainer.devices={processes}", f"data.seq_len={SEQ}", f"trainer.max_steps={steps}",
        "trainer.warmup_steps=2", "trainer.log_every_n_steps=1", "trainer.val_check_interval=100000",
        "trainer.val_at_start=false", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "trainer.enable_checkpointing=false",
        "callbacks=[]", f"trainer.default_root_dir={root}",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: trainer fit failed: {done.stderr.strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(
        r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r and r["step"] > 5
    )


def _load() -> str:
    """The 1, 5 and 15 minute load averages (uptime's)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _order(values: list[float]) -> list[int]:
    return sorted(range(len(values)), key=lambda i: -values[i])


def _host(rates: Rates, name: str) -> str:
    """The doctor's sharding host time `name` of each kind, in ms: 'tp 15.1, fsdp 8.2 ms'."""
    return (
        ", ".join(f"{kind} {found.get(name, 0.0) * 1e3:.1f}" for kind, found in rates.sharded.items()) + " ms"
    )


def _pairs(names: list[str], predicted_order: list[int], rounds: list[list[float]]) -> str:
    """The predicted ranking pair by pair against the pairs the rounds decide: one layout measured faster
    than the other in every round (their rounds' ranges do not overlap). On a host whose speed drifts
    between runs, a pair whose ranges overlap has no measured order to match."""
    right, wrong, undecided = [], [], []
    for a, i in enumerate(predicted_order):
        for j in predicted_order[a + 1 :]:  # predicted: i faster than j
            pair = f"{names[i]} > {names[j]}"
            if min(rounds[i]) > max(rounds[j]):
                right.append(pair)
            elif min(rounds[j]) > max(rounds[i]):
                wrong.append(pair)
            else:
                undecided.append(pair)
    text = f"{len(right)} of the {len(right) + len(wrong)} pairs the rounds decide in the predicted order"
    if wrong:
        text += f"; the wrong way round: {', '.join(wrong)}"
    return text + (f"; undecided (rounds overlap): {', '.join(undecided)}" if undecided else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=Path, default=None, help="a rates file (default: run trainer doctor)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep-rates", type=Path, default=None, help="copy the doctor's rates file here")
    parser.add_argument(
        "--measured",
        default=None,
        help="tokens/s of the 5 layouts, comma-separated, from an earlier run (with --rates: predict only)",
    )
    args = parser.parse_args()
    if args.measured is not None and args.rates is None:
        parser.error("--measured needs --rates (the rates of the run that measured them)")
    with tempfile.TemporaryDirectory() as tmp:
        source = "given" if args.rates else "trainer doctor --devices 2"
        print(f"load before: {_load()}", flush=True)
        rates_path = args.rates or doctor_rates(Path(tmp) / "rates.json")
        if args.keep_rates is not None:
            args.keep_rates.write_text(Path(rates_path).read_text())
        rates = Rates.read(rates_path)
        shape = plan_inputs(load_recipe(RECIPE, [*BASE, f"data.seq_len={SEQ}"])).shape
        rounds: list[list[float]] = [[] for _ in LAYOUTS]
        if args.measured is not None:
            rounds = [[float(x)] for x in args.measured.split(",")]
            if len(rounds) != len(LAYOUTS):
                parser.error(f"--measured has {len(rounds)} values; allowed: {len(LAYOUTS)}, one per layout")
        for r in range(args.rounds if args.measured is None else 0):
            order = [(i + r) % len(LAYOUTS) for i in range(len(LAYOUTS))]
            for i in order:
                name, n, layout, run = LAYOUTS[i]
                root = Path(tmp) / f"run{i}-{r}"
                rounds[i].append(measured_tokens_per_s(name, n, layout, run, root, args.steps))
            print(
                f"round {r + 1}: "
                + ", ".join(f"{LAYOUTS[i][0]} {rounds[i][-1]:,.0f}" for i in range(len(LAYOUTS)))
                + f" tokens/s; load {_load()}",
                flush=True,
            )
        measured = [statistics.median(found) for found in rounds]
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    raw_hw = measured_hardware(rates, host / 2, gpus_per_node=2)
    raw = [step_time(shape, layout, run, raw_hw) for _, _, layout, run in LAYOUTS]
    # calibrated: the compute rate that makes the single process's prediction its measurement
    efficiency = measured[0] / raw[0].tokens_per_s * raw[0].compute_s / raw[0].step_s
    calibrated_hw = dataclasses.replace(
        raw_hw, rates=dataclasses.replace(rates, matmul_tflops=rates.matmul_tflops * efficiency)
    )
    calibrated = [step_time(shape, layout, run, calibrated_hw) for _, _, layout, run in LAYOUTS]
    together = calibrated_hw.sharing(2)
    fit = rates.latency_bandwidth("all_gather", "world")
    print(
        f"tiny Llama (vocab 258), {GLOBAL} x {SEQ} tokens per step, gloo, {os.cpu_count()} cores; rates from "
        f"{source}: matmul {rates.matmul_tflops * 1e3:.1f} GFLOP/s per rank ({together:.2f} x that with 2 "
        f"ranks at once), all-reduce busbw {rates.intra_busbw_GBps:.2f} GB/s, all-gather latency "
        f"{(fit[0] * 1e6 if fit else 0):.0f} us, host time per block pass {_host(rates, 'block_s')}, per pass {_host(rates, 'pass_s')}, "
        f"per step {_host(rates, 'step_block_s')} per block + {_host(rates, 'step_s')}; calibration: compute at {efficiency:.2f} x the doctor's "
        f"matmul rate; measured: median of {args.rounds} rounds of {args.steps} steps; load now {_load()}"
    )
    print(
        f"  {'layout':<10} {'measured':>10} {'raw':>10} {'err':>7} {'calibrated':>11} {'err':>7}  dominant (calibrated)"
    )
    for (name, *_), m, r, c in zip(LAYOUTS, measured, raw, calibrated, strict=True):
        print(
            f"  {name:<10} {m:>10,.0f} {r.tokens_per_s:>10,.0f} {r.tokens_per_s / m - 1:>+7.0%} "
            f"{c.tokens_per_s:>11,.0f} {c.tokens_per_s / m - 1:>+7.0%}  {c.dominant}"
        )
    for (name, *_), c in zip(LAYOUTS, calibrated, strict=True):
        print(f"  {name:<10} calibrated: {c.line()}")
    names = [name for name, *_ in LAYOUTS]
    for label, predicted in (("raw", raw), ("calibrated", calibrated)):
        p_order = _order([t.tokens_per_s for t in predicted])
        m_order = _order(measured)
        same = "matches" if p_order == m_order else "differs from"
        worst = max(abs(t.tokens_per_s / m - 1) for t, m in zip(predicted, measured, strict=True))
        print(
            f"  {label}: worst error {worst:.0%} ({'within' if worst <= 0.25 else 'outside'} 25%); predicted "
            f"ranking {' > '.join(names[i] for i in p_order)} {same} measured {' > '.join(names[i] for i in m_order)}"
        )
        print(f"  {label}: {_pairs(names, p_order, rounds)}")


if __name__ == "__main__":
    main()
