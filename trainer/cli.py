"""`trainer fit|validate|test|config RECIPE.yaml [key.path=value ...]`: run a recipe from the shell."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import yaml

from callbacks.checkpoint import ModelNotFiniteError
from trainer.checkpoint import CheckpointError, find_last
from trainer.checkpoint.export import export_checkpoint, export_llama
from trainer.checkpoint.run_folder import FolderInUse
from trainer.commands import doctor, lighthouse, plan, replicas
from trainer.config import SECTIONS, ConfigError, build_run, load_recipe, memory_lines
from trainer.core.logging import configure_console_logging
from trainer.fault_tolerance.config import NoQuorumError
from trainer.models.hf import HFModule
from trainer.models.hf_adapters import BaseModelMismatch
from trainer.models.llama import Llama

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
  trainer memory recipes/llama_70b.yaml                     # weights+grads+AdamW and the peak per GPU
  trainer memory recipes/moe_deepseek_v3_like.yaml          # MoE: experts split over ep and the expert mesh
  trainer plan recipes/llama_70b.yaml --gpus 512            # rank the layouts of 512 H100s, print the best
  trainer plan recipes/llama_8b.yaml --gpus 8 --write plan.yaml --measured rates.json
  trainer doctor --devices 4 --out rates.json               # collectives' busbw measured (gloo here, NCCL on GPUs)
"""


# subcommands with a module each
TOOLS = {"doctor": doctor, "plan": plan, "lighthouse": lighthouse, "replicas": replicas}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainer",
        description="Train, validate or test from a recipe YAML.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="{fit,validate,test,config,memory,plan,doctor,lighthouse,replicas,export}",
    )
    for name, text in (
        ("fit", "train (with validation) as the recipe describes"),
        ("validate", "validation loss of a checkpoint (default: the run's last)"),
        ("test", "test loss of a checkpoint (default: the run's last)"),
        ("config", "print the fully resolved recipe and exit"),
        ("memory", "per GPU of the layout: weights, gradients, AdamW state, the peak with activations"),
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
    for tool in TOOLS.values():
        tool.add_parser(sub)
    args = _parse(parser, argv)
    configure_console_logging()
    if args.command in TOOLS:
        return TOOLS[args.command].run(args)
    if args.command == "export":
        try:
            print(f"wrote {export_checkpoint(args.checkpoint, args.out, merged=not args.adapter)}")
        except (CheckpointError, OSError, ValueError) as err:  # OSError: the output path or disk, named
            where = f" (writing {args.out})" if isinstance(err, OSError) and not err.filename else ""
            print(f"trainer: error: {err}{where}", file=sys.stderr)
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
        trainer.resume_hint = "--ckpt-path last"
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
    # OSError: a file or folder the system refused (permissions, a full disk); its line names the path
    except (
        ConfigError, CheckpointError, OSError, FolderInUse, ModelNotFiniteError, BaseModelMismatch,
        NoQuorumError,
    ) as err:  # fmt: skip
        print(f"trainer: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a Ctrl-C before training, or the second one (the first stops cleanly)
        print(
            "trainer: aborted by Ctrl-C; the run keeps the checkpoints it had (--ckpt-path last)",
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    return 0


def _version() -> str:
    """The installed package's version (pyproject.toml's, as pip recorded it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


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
