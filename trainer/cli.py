"""`trainer fit|validate|test|config RECIPE.yaml [key.path=value ...]`: run a recipe from the shell."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from callbacks.checkpoint import ModelNotFiniteError
from trainer.checkpoint import CheckpointError, find_last
from trainer.config import SECTIONS, ConfigError, build_run, load_recipe, memory_lines
from trainer.export import export_checkpoint, export_llama
from trainer.logging import configure_console_logging
from trainer.models.hf import HFModule
from trainer.models.llama import Llama
from trainer.run_folder import FolderInUse

EPILOG = f"""recipe sections: {", ".join(SECTIONS)}
  model      a Llama preset (tiny, 1b, 8b, 70b) with any LlamaConfig field, or class_path + init_args,
             or hf: a local Hugging Face model folder fine-tuned for task (causal-lm, seq-classification,
             token-classification, seq2seq) with num_labels, freeze patterns and lora (peft.LoraConfig
             fields: checkpoints then hold the adapters only)
  data       path (none: the embedded corpus), tokenizer (byte or a local path), seq_len, batch_size, val_fraction;
             with model.hf also val_path, text_field, label_field, prompt_field + response_field or messages_field
  optimizer  AdamW lr, betas, weight_decay, eps
  trainer    every Trainer flag (max_steps, precision, lr_schedule, warmup_steps, default_root_dir, ...)
  strategy   name (auto, single, ...) and the strategy's arguments
  callbacks  a list of {{class_path, init_args}}
  loggers    a list of names (jsonl, tensorboard, wandb) or {{class_path, init_args}}
  fault_tolerance  torchft replica group: lighthouse (host:port), replica_id, replicas, min_replicas,
             timeout_s, quorum_timeout_s, bind (see `trainer lighthouse`)

examples:
  trainer fit recipes/llama_tiny.yaml
  trainer fit recipes/llama_tiny.yaml trainer.max_steps=50 optimizer.lr=1e-3
  trainer fit recipes/llama_tiny.yaml --ckpt-path last      # resume (or start) the run
  trainer config recipes/llama_tiny.yaml data.seq_len=128   # print the resolved recipe
  trainer export runs/llama_tiny/checkpoints/step-00000300 out/  # weights for transformers
  trainer export runs/NAME/checkpoints/step-N out/ --adapter     # LoRA as PEFT's adapter files
  trainer fit recipes/hf_classify_minilm.yaml model.lora='{{r: 8, target_modules: [query, value]}}'
  trainer memory recipes/llama_70b.yaml                     # weights+grads+AdamW per GPU of the layout
  trainer memory recipes/moe_deepseek_v3_like.yaml          # MoE: experts split over ep and the expert mesh
  trainer plan recipes/llama_70b.yaml --gpus 512            # rank the layouts of 512 H100s, print the best
  trainer plan recipes/llama_8b.yaml --gpus 8 --write plan.yaml --measured rates.json
  trainer doctor --devices 4 --out rates.json               # collectives' busbw measured (gloo here, NCCL on GPUs)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainer",
        description="Train, validate or test from a recipe YAML.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="{fit,validate,test,config,memory,plan,doctor,lighthouse,export}",
    )
    for name, text in (
        ("fit", "train (with validation) as the recipe describes"),
        ("validate", "validation loss of a checkpoint (default: the run's last)"),
        ("test", "test loss of a checkpoint (default: the run's last)"),
        ("config", "print the fully resolved recipe and exit"),
        ("memory", "weights, gradients and AdamW state per GPU of the recipe's layout, computed on this CPU"),
    ):
        cmd = sub.add_parser(
            name,
            help=text,
            description=text,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        cmd.add_argument("recipe", type=Path, help="a recipe YAML file")
        cmd.add_argument("overrides", nargs="*", metavar="key.path=value", help="override recipe values")
        if name not in ("config", "memory"):
            default = None if name == "fit" else "last"
            cmd.add_argument(
                "--ckpt-path",
                default=default,
                help=f"'last', a checkpoint directory, or none (default: {default})",
            )
    export = sub.add_parser(
        "export",
        help="consolidate a checkpoint (sharded ones too) into model.safetensors",
        description="Write a checkpoint's weights to OUT/model.safetensors (+ config.json "
        "in Hugging Face layout for a Llama), on one process, whatever world size saved it.",
    )
    export.add_argument("checkpoint", type=Path, help="a checkpoint directory (runs/NAME/checkpoints/step-N)")
    export.add_argument("out", type=Path, help="output directory")
    export.add_argument(
        "--adapter",
        action="store_true",
        help="an HFModule's LoRA run: write PEFT's adapter_config.json + adapter_model.safetensors "
        "(peft.PeftModel.from_pretrained(base, OUT)) instead of the merged model",
    )
    _add_doctor(sub)
    _add_plan_parser(sub)
    _add_lighthouse(sub)
    args = _parse(parser, argv)
    configure_console_logging()
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "lighthouse":
        return _lighthouse(args)
    if args.command == "export":
        try:
            print(f"wrote {export_checkpoint(args.checkpoint, args.out, merged=not args.adapter)}")
        except (CheckpointError, FileNotFoundError, ValueError) as err:
            print(f"trainer: error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        config = load_recipe(args.recipe, args.overrides)
        if args.command == "config":
            print(yaml.safe_dump(config, sort_keys=False), end="")
            return 0
        if args.command == "memory":
            print(memory_lines(config))
            return 0
        trainer, module, train_loader, val_loader = build_run(config)
        ckpt = None if args.ckpt_path in (None, "none", "None") else args.ckpt_path
        if args.command == "fit":
            trainer.fit(module, train_loader, val_loader, ckpt_path=ckpt)
            if isinstance(module, HFModule):  # every rank: sharded weights are gathered to rank 0
                exported = module.save_pretrained(Path(trainer.default_root_dir) / "export")
                if trainer.is_global_zero:
                    _report(trainer, _weights_file(exported))
            elif trainer.is_global_zero:
                _report(trainer, _export(trainer, module))
        else:
            metrics = getattr(trainer, args.command)(module, val_loader, ckpt_path=ckpt)
            if trainer.is_global_zero:
                print(yaml.safe_dump(metrics, sort_keys=False), end="")
    except (ConfigError, CheckpointError, FileNotFoundError, FolderInUse, ModelNotFiniteError) as err:
        print(f"trainer: error: {err}", file=sys.stderr)
        return 2
    return 0


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    """`trainer doctor`: the collectives of the world it runs in, measured."""
    doctor = sub.add_parser(
        "doctor",
        help="measure all-reduce/all-gather/reduce-scatter/all-to-all bus bandwidth of this world",
        description="Launched like a fit (self-spawns --devices processes: gloo on the CPU, NCCL on GPUs; under "
        "torchrun or SLURM it measures the job's world), times each collective per group and message size "
        "and prints busbw as nccl-tests defines it against the link's nominal rate; on GPUs also the NVML "
        "topology, ECC/XID state and the NCCL variables in effect, with hints.",
    )
    doctor.add_argument(
        "--devices", type=int, help="processes on this node (default: every GPU, or 2 on the CPU)"
    )
    doctor.add_argument(
        "--sizes", help="message sizes in bytes, comma-separated: 64K,1M,1G (default per backend)"
    )
    doctor.add_argument("--mesh", help="also measure each dimension of a mesh, e.g. dp_shard=2,tp=2")
    doctor.add_argument(
        "--gpus-per-node",
        type=int,
        help="ranks per node for the intra/inter-node split (default: the launcher's)",
    )
    doctor.add_argument("--warmup", type=int, help="untimed calls per size (default: 2 on gloo, 5 on NCCL)")
    doctor.add_argument("--iters", type=int, help="timed calls per size (default: 5 on gloo, 20 on NCCL)")
    doctor.add_argument(
        "--out", type=Path, help="write the rates file (JSON, GB/s) that `trainer plan` reads"
    )


def _doctor(args: argparse.Namespace) -> int:
    from trainer.doctor.run import DoctorOptions, doctor

    options = DoctorOptions(
        devices=args.devices,
        sizes=args.sizes,
        mesh=args.mesh,
        gpus_per_node=args.gpus_per_node,
        warmup=args.warmup,
        iters=args.iters,
        out=args.out,
    )
    try:
        report = doctor(options)
    except ValueError as err:
        print(f"trainer: error: {err}", file=sys.stderr)
        return 2
    if report is not None:
        print(report)
    return 0


# ---- trainer plan -------------------------------------------------------------------------------------
def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
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


def _plan(args: argparse.Namespace) -> int:
    """`trainer plan`: the table, the why-line, the overrides and the checkpoint interval."""
    from strategies.plan.hardware import Rates, build_hardware, parse_bytes
    from trainer.config.plan_inputs import layout_overrides, override_args, plan_for

    try:
        if args.gpus < 1 or args.gpus_per_node < 1 or args.top < 1:
            raise ConfigError(
                f"--gpus {args.gpus}, --gpus-per-node {args.gpus_per_node}, --top {args.top}: allowed: ints >= 1"
            )
        config = load_recipe(args.recipe, args.overrides)
        try:
            rates = Rates.read(args.measured) if args.measured is not None else None
            memory = parse_bytes(args.gpu_memory) if args.gpu_memory is not None else None
            hardware = build_hardware(
                args.device, args.gpus_per_node, args.link, gpu_memory=memory, rates=rates
            )
        except ValueError as err:
            raise ConfigError(str(err)) from err
        plan, inputs = plan_for(config, args.gpus, hardware)
    except (ConfigError, FileNotFoundError) as err:
        print(f"trainer: error: {err}", file=sys.stderr)
        return 2
    best = plan.best
    overrides = layout_overrides(config, best.layout, best.run, inputs.global_batch)
    print("\n".join(_plan_lines(args, plan, inputs, hardware)))
    print("overrides: " + " ".join(override_args(config, overrides)))
    print(_checkpoint_line(args, inputs, best))
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
        f"{plan.tried} layouts tried, {plan.too_big} over the memory; the fastest of each mesh:",
        f"  {'#':>2}  {'layout':<52} {'mb':>3} {'GB/GPU':>7} {'tokens/s':>12} {'MFU':>6}  dominant",
    ]
    for i, c in enumerate(plan.ranked[: args.top], 1):
        lines.append(
            f"  {i:>2}  {layout_text(c.layout):<52} {pass_size(c):>3} {c.peak_bytes / GB:>7.1f} "
            f"{c.time.tokens_per_s:>12,.0f} {c.time.mfu:>6.1%}  {c.time.dominant}"
        )
    lines.append(f"why: {plan.why}")
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


def _add_lighthouse(sub: argparse._SubParsersAction) -> None:
    """`trainer lighthouse`: torchft's coordinator of fault-tolerant replica groups (trainer/fault_tolerance)."""
    lighthouse = sub.add_parser(
        "lighthouse",
        help="run the lighthouse that fault-tolerant replica groups join (Trainer(fault_tolerance=...))",
        description="Run torchft's lighthouse until SIGINT/SIGTERM; its first line of output is the "
        "address the replica groups join (FaultTolerance(lighthouse=...)).",
    )
    lighthouse.add_argument(
        "--bind", required=True, help="host:port to listen on (port 0: one the system picks)"
    )
    lighthouse.add_argument("--min-replicas", type=int, default=1, help="groups a quorum needs (default 1)")
    lighthouse.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="a silent group is dead after this (default 5000)",
    )
    lighthouse.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60000,
        help="a quorum waits this long for late groups (default 60000)",
    )


def _lighthouse(args: argparse.Namespace) -> int:
    from trainer.fault_tolerance.lighthouse import run_lighthouse  # torchft only when asked for

    try:
        return run_lighthouse(args.bind, args.min_replicas, args.heartbeat_timeout_ms, args.join_timeout_ms)
    except (ImportError, ValueError) as err:
        print(f"trainer: error: {err}", file=sys.stderr)
        return 2


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line, options anywhere: argparse ends a command's `key=value` list at the first option,
    so the overrides after one come back unrecognised and are appended here, in their order."""
    args, rest = parser.parse_known_args(argv)
    options = [item for item in rest if item.startswith("-")]
    if options or (rest and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(options or rest)}")
    if rest:
        args.overrides = [*args.overrides, *rest]
    return args


def _export(trainer, module) -> Path | None:
    """The trained weights as `<root>/export/model.safetensors`, from the final checkpoint (any strategy,
    sharded too), else from the live model when it is a whole Llama."""
    out = Path(trainer.default_root_dir) / "export"
    last = find_last(trainer.checkpoint_dir)
    if last is not None:
        return export_checkpoint(last, out)
    from torch.distributed.tensor import DTensor

    model = getattr(module, "model", None)
    dense = isinstance(model, Llama) and model.config.moe is None  # a MoE Llama has no transformers class
    if dense and not any(isinstance(p, DTensor) for p in model.parameters()):
        return export_llama(model, out)
    return None


def _weights_file(out: Path) -> Path:
    """The weights `save_pretrained` wrote to `out`: one file, or the index of its shards."""
    index = out / "model.safetensors.index.json"
    return index if index.exists() else out / "model.safetensors"


def _report(trainer, exported: Path | None) -> None:
    """Where the run's outputs are, and how it ended."""
    metrics = trainer.callback_metrics
    lines = [f"done: {trainer.global_step} steps"]
    if "val/loss" in metrics:
        lines[0] += f", val/loss {metrics['val/loss']:.4f}"
    lines.append(f"  metrics      {Path(trainer.default_root_dir) / 'logs' / 'metrics.jsonl'}")
    last = find_last(trainer.checkpoint_dir)
    if last is not None:
        lines.append(f"  checkpoint   {last}  (weights, optimizer, loop state; resume with --ckpt-path last)")
    if exported is not None and (exported.parent / "config.json").exists():
        lines.append(
            f"  weights      {exported}  (Hugging Face layout: from_pretrained('{exported.parent}'))"
        )
    elif exported is not None:
        lines.append(f"  weights      {exported}")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
