"""`trainer plan`: the layouts of N GPUs ranked by the memory and step-time models (strategies/plan)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import yaml

from trainer.commands.plan_goodput import add_arguments as add_goodput_arguments
from trainer.commands.plan_goodput import goodput_lines
from trainer.config import ConfigError, load_recipe


def add_parser(sub: argparse._SubParsersAction) -> None:
    text = "rank the layouts of N GPUs by predicted tokens/s (memory and step-time models), print the best"
    cmd = sub.add_parser("plan", help=text, description=text)
    cmd.add_argument("recipe", type=Path, help="a Llama recipe YAML file")
    cmd.add_argument("overrides", nargs="*", metavar="key.path=value", help="override recipe values")
    cmd.add_argument("--gpus", type=int, required=True, help="GPUs of the planned run")
    cmd.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    cmd.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GB (default: the device's)")
    cmd.add_argument("--device", default="h100", help="h100, h200, b200 or a100 (default h100)")
    cmd.add_argument(
        "--link", default="ib-ndr", help="the inter-node link: ib-ndr, roce, pcie5, ... (default ib-ndr)"
    )
    cmd.add_argument("--measured", type=Path, default=None, help="a rates file of `trainer doctor --out`")
    cmd.add_argument("--mtbf-hours", type=float, default=None,
                     help="the job's mean time between failures (default: Llama 3's rate scaled to --gpus)")  # fmt: skip
    cmd.add_argument("--storage-gbps", type=float, default=1.0,
                     help="checkpoint write rate per node in GB/s, for the save cost (default 1)")  # fmt: skip
    cmd.add_argument("--top", type=int, default=8, help="layouts listed (default 8)")
    cmd.add_argument("--write", type=Path, default=None, help="write the chosen layout's overrides as YAML")
    cmd.add_argument("--keep", default=None, metavar="tp=8,pp=16",
                     help="only layouts with these dimensions, e.g. tp=8,pp=16,activation_checkpointing=full "
                          "(a layout's degrees, zero_stage, pp_schedule, pp_microbatches, micro_batch)")  # fmt: skip
    add_goodput_arguments(cmd)
    cmd.add_argument("--noise-scale", default=None, metavar="B|FILE",
                     help="the gradient noise scale in sequences, or a metrics file or run folder where "
                     "GradientNoiseScale logged it: warn when the global batch is far beyond it, and print "
                     "tokens/s and time to the target loss against the GPU count")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """`trainer plan`: the table, the why-line, the overrides and the checkpoint interval."""
    from strategies.plan.hardware import Rates, build_hardware, parse_bytes
    from strategies.plan.keep import parse_keep
    from strategies.plan.scaling import noise_scale_report, read_noise_scale
    from trainer.commands.plan_score import recipe_lines
    from trainer.config.plan_inputs import layout_overrides, override_args, plan_for

    try:
        if args.gpus < 1 or args.gpus_per_node < 1 or args.top < 1:
            raise ConfigError(
                f"--gpus {args.gpus}, --gpus-per-node {args.gpus_per_node}, --top {args.top}: allowed: ints >= 1"
            )
        for name, value in (("--storage-gbps", args.storage_gbps), ("--mtbf-hours", args.mtbf_hours)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} {value}; allowed: a finite number > 0")
        config = load_recipe(args.recipe, args.overrides)
        try:
            noise = None if args.noise_scale is None else read_noise_scale(args.noise_scale)
            rates = Rates.read(args.measured) if args.measured is not None else None
            memory = parse_bytes(args.gpu_memory) if args.gpu_memory is not None else None
            hardware = build_hardware(
                args.device, args.gpus_per_node, args.link, gpu_memory=memory, rates=rates
            )
            keep = parse_keep(args.keep, args.gpus) if args.keep is not None else None
        except ValueError as err:
            raise ConfigError(str(err)) from err
        plan, inputs = plan_for(config, args.gpus, hardware, keep=keep)
    except (ConfigError, FileNotFoundError) as err:
        print(f"trainer: error: {err}", file=sys.stderr)
        return 2
    best = plan.best
    overrides = layout_overrides(config, best.layout, best.run, inputs.global_batch)
    print("\n".join(_plan_lines(args, plan, inputs, hardware)))
    print("\n".join(recipe_lines(config, args.gpus, hardware, plan, inputs, keep)))
    print("overrides: " + " ".join(override_args(config, overrides)))
    print(_checkpoint_line(args, inputs, best))
    if args.goodput:
        print("\n".join(goodput_lines(args, best, inputs, hardware)))
    if noise is not None:
        print("\n".join(noise_scale_report(inputs, hardware, args.gpus, *noise)))
    if args.write is not None:
        nested: dict = {}
        for key, value in overrides.items():
            section, name = key.split(".", 1)
            nested.setdefault(section, {})[name] = value
        args.write.write_text(yaml.safe_dump(nested, sort_keys=False))
        print(f"wrote {args.write}")
    return 0


def _plan_lines(args: argparse.Namespace, plan, inputs, hardware) -> list[str]:
    from strategies.plan.hardware import GB, describe
    from strategies.plan.search import layout_text, pass_size
    from strategies.plan.step_time import dense_params, expert_params

    shape = inputs.shape
    params = (dense_params(shape) + expert_params(shape)) / 1e9
    tokens = inputs.global_batch * inputs.seq_len
    lines = [
        f"{params:.1f}B-parameter Llama ({shape.n_layers} blocks, dim {shape.dim}), sequences of {inputs.seq_len}, "
        f"global batch {inputs.global_batch} ({tokens / 1e6:.2f}M tokens), {inputs.precision}",
        f"{args.gpus} x {describe(hardware)}",
        f"{plan.tried} layouts tried{f' (--keep {args.keep})' if args.keep else ''}, {plan.too_big} over the "
        "memory; the fastest of each mesh:",
        f"  {'#':>2}  {'layout':<52} {'mb':>3} {'GB/GPU':>7} {'tokens/s':>12} {'MFU':>6}  dominant",
    ]
    for i, c in enumerate(plan.ranked[: args.top], 1):
        lines.append(
            f"  {i:>2}  {layout_text(c.layout):<52} {pass_size(c):>3} {c.peak_bytes / GB:>7.1f} "
            f"{c.time.tokens_per_s:>12,.0f} {c.time.mfu:>6.1%}  {c.time.dominant}"
        )
    lines.append(f"why: {plan.why}")
    if plan.versus is not None:
        lines.append(f"vs {plan.versus}")
    return lines


def _checkpoint_line(args: argparse.Namespace, inputs, best) -> str:
    """Young/Daly's interval for the planned run: the save cost from the checkpoint's size (fp32 weights
    and AdamW state, 12 bytes a parameter, written by every node at --storage-gbps) and the MTBF."""
    from strategies.plan.checkpoint_interval import effective_fraction, llama3_mtbf_s, young_daly_interval
    from strategies.plan.step_time import dense_params, expert_params

    shape = inputs.shape
    size = 12 * (dense_params(shape) + expert_params(shape))
    nodes = max(1, -(-args.gpus // args.gpus_per_node))
    save = size / (args.storage_gbps * 1e9 * nodes)
    mtbf = args.mtbf_hours * 3600 if args.mtbf_hours is not None else llama3_mtbf_s(args.gpus)
    source = "given" if args.mtbf_hours is not None else f"Llama 3's failure rate at {args.gpus} GPUs"
    interval = young_daly_interval(save, mtbf)
    steps = max(1, round(interval / best.time.step_s))
    return (
        f"checkpoint: save ~{save:.0f}s ({size / 1e9:.0f} GB over {nodes} node(s) at {args.storage_gbps:g} GB/s), "
        f"MTBF {mtbf / 3600:.1f}h ({source}): every {interval / 60:.0f} min = every_n_steps {steps} "
        f"(Young/Daly sqrt(2 C MTBF)); effective training time {effective_fraction(save, interval, mtbf):.1%}"
    )
