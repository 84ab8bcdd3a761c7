"""Objects from a resolved recipe: the Trainer, the module and its loaders (a Llama preset, a class_path
model or a Hugging Face one), and the memory plan of a sharded Llama recipe."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from trainer.config.checks import check_init_args, import_path
from trainer.config.load import build_llama_config
from trainer.config.schema import NEW_HF, ConfigError


def build_run(config: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """(trainer, module, train_loader, val_loader) described by a resolved config; the Trainer (whose
    flags are checked on construction) comes first so a bad flag fails before data is read."""
    import torch

    from strategies.registry import build_strategy
    from trainer.data import lm_dataloaders
    from trainer.fault_tolerance import FaultTolerance
    from trainer.models.causal_lm import CausalLM
    from trainer.module import TrainModule
    from trainer.trainer import Trainer

    if config["strategy"]["name"] == "auto":
        config = _planned(config)
    model, data, optim = config["model"], config["data"], config["optimizer"]
    trainer_args, strategy = dict(config["trainer"]), dict(config["strategy"])
    try:
        built_strategy = build_strategy(strategy.pop("name"), processes=_processes(trainer_args), **strategy)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"strategy: {err}") from err
    callbacks = [_instantiate(c, f"callbacks[{i}]") for i, c in enumerate(config["callbacks"])]
    loggers = [_instantiate(c, f"loggers[{i}]") for i, c in enumerate(config["loggers"])]
    ft = config.get("fault_tolerance")
    try:
        trainer = Trainer(
            strategy=built_strategy,
            callbacks=callbacks,
            loggers=loggers,
            fault_tolerance=FaultTolerance(**ft) if ft else None,
            **trainer_args,
        )
    except (ValueError, TypeError) as err:
        raise ConfigError(f"trainer: {err}") from err
    except ImportError as err:  # fault_tolerance without torchft: the one-line install hint
        raise ConfigError(f"fault_tolerance: {err}") from err
    batch_size = _micro_batch(data, trainer_args, trainer.strategy.planned_group_size("batch"))
    try:
        trainer.strategy.check_batch(batch_size, data["seq_len"])
    except ValueError as err:
        raise ConfigError(f"strategy: {err}") from err
    optim_args = {**optim, "betas": tuple(optim["betas"])}
    causal_lm_args = {**optim_args, "loss_chunk_tokens": model["loss_chunk_tokens"]}
    if model["hf"] is not None:
        module, train_loader, val_loader = _build_hf(
            model, data, optim, batch_size, trainer_args.get("seed") or 0
        )
        return trainer, module, train_loader, val_loader
    llama = build_llama_config(model) if model["class_path"] is None else None
    if llama is not None and data["seq_len"] > llama.max_seq_len:
        raise ConfigError(f"data.seq_len={data['seq_len']} exceeds model.max_seq_len={llama.max_seq_len}")
    try:
        train_loader, val_loader, tokenizer = lm_dataloaders(
            data["path"],
            tokenizer=data["tokenizer"],
            seq_len=data["seq_len"],
            batch_size=batch_size,
            val_fraction=data["val_fraction"],
            seed=trainer_args.get("seed") or 0,
            cache_dir=data["cache_dir"],
            text_field=data["text_field"],
        )
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"data: {err}") from err
    if llama is not None:
        module = CausalLM(
            dataclasses.replace(llama, vocab_size=max(llama.vocab_size, tokenizer.vocab_size)),
            **causal_lm_args,
        )
    else:
        cls = import_path(model["class_path"], "model.class_path")
        check_init_args(cls, model["init_args"], "model.init_args")
        built = cls(**model["init_args"])
        if not isinstance(built, torch.nn.Module):
            raise ConfigError(
                f"model.class_path {model['class_path']} built a {type(built).__name__}; allowed: a TrainModule or nn.Module"
            )
        if isinstance(built, TrainModule) and model["loss_chunk_tokens"] is not None:
            raise ConfigError(
                f"model.loss_chunk_tokens is set but model.class_path {model['class_path']} is a TrainModule "
                "with its own loss; allowed: null, or a class_path nn.Module (trained by CausalLM)"
            )
        module = built if isinstance(built, TrainModule) else CausalLM(built, **causal_lm_args)
    return trainer, module, train_loader, val_loader


CLASSIFY = ("seq-classification", "token-classification")  # the tasks whose labels may be class names


def _build_hf(
    model: dict[str, Any], data: dict[str, Any], optim: dict[str, Any], batch_size: int, seed: int
) -> tuple[Any, Any, Any]:
    """An HFModule and its loaders (trainer.data.hf_data) for a recipe whose model is `hf`."""
    from trainer.data.hf_data import class_names, hf_dataloaders, load_hf_dataset
    from trainer.data.rows import DataError
    from trainer.models.hf import HFModule
    from trainer.models.hf_create import ensure_hf_llama

    path = model["hf"]
    if path.startswith("py:"):
        path = str(import_path(path[3:], "model.hf")())
    elif path.startswith(NEW_HF):
        try:
            path = str(ensure_hf_llama(path[len(NEW_HF) :], model["hf_config"]))
        except ValueError as err:
            raise ConfigError(str(err)) from err
    if not Path(path).is_dir():
        raise ConfigError(
            f"model.hf={path!r} is not a directory; allowed: a local Hugging Face model directory"
        )
    try:
        source = data["path"]
        if source is None:
            raise ConfigError(
                "data.path is required with model.hf; allowed: a local data file or save_to_disk folder"
            )
        if data["val_path"] is not None:
            import datasets

            source = datasets.DatasetDict(
                train=load_hf_dataset(data["path"], split="train"),
                validation=load_hf_dataset(data["val_path"], split="train"),
            )
        # string or ClassLabel labels: their names become the head's id2label (and the export's)
        names = class_names(source, data["label_field"], model["task"]) if model["task"] in CLASSIFY else None
        module = HFModule(
            path, task=model["task"], num_labels=model["num_labels"], lr=optim["lr"],
            weight_decay=optim["weight_decay"], betas=tuple(optim["betas"]), freeze=model["freeze"],
            lora=model["lora"], labels=names, reference=model["reference"], beta=model["beta"],
        )  # fmt: skip
        if model["task"] == "dpo":  # preference pairs: data.prompt_field names the prompt column
            from trainer.data.hf_preference import preference_dataloaders

            train_loader, val_loader = preference_dataloaders(
                source, module.tokenizer, seq_len=data["seq_len"], batch_size=batch_size,
                val_fraction=data["val_fraction"], seed=seed, prompt_field=data["prompt_field"] or "prompt",
                cache_dir=data["cache_dir"], skip_bad_rows=data["skip_bad_rows"],
            )  # fmt: skip
            return module, train_loader, val_loader
        train_loader, val_loader = hf_dataloaders(
            source, module.tokenizer, model["task"], seq_len=data["seq_len"], batch_size=batch_size,
            val_fraction=data["val_fraction"], seed=seed, text_field=data["text_field"],
            prompt_field=data["prompt_field"], response_field=data["response_field"],
            messages_field=data["messages_field"], label_field=data["label_field"], packing=data["packing"],
            cache_dir=data["cache_dir"], labels=names, sft_packing=data["sft_packing"],
            skip_bad_rows=data["skip_bad_rows"],
        )  # fmt: skip
    except DataError as err:  # a data file or row: its own section, not model.hf's
        raise ConfigError(f"data: {err}") from err
    except (ValueError, FileNotFoundError, ImportError) as err:
        raise ConfigError(f"model.hf: {err}") from err
    return module, train_loader, val_loader


def memory_lines(config: dict[str, Any]) -> str:
    """Per-GPU weights, gradients and AdamW state of a resolved Llama recipe under its sharding
    strategy, one line per pipeline stage (strategies/plan/shards_on_meta.py, read off the sharded model), then
    each stage's peak with activations and transients (strategies/plan/memory.py), without any GPU or
    process."""
    from strategies.plan.from_strategy import layout_of
    from strategies.plan.memory import per_stage_memory
    from strategies.plan.model_shape import shape_of
    from strategies.plan.shapes import RunShape
    from strategies.plan.shards_on_meta import plan_memory
    from strategies.registry import build_strategy
    from trainer.core.precision import Precision
    from trainer.models.causal_lm import CausalLM

    trainer_args, strategy_args = config["trainer"], dict(config["strategy"])
    name = strategy_args.pop("name")
    if not isinstance(trainer_args["devices"], int) or config["model"]["class_path"] is not None:
        raise ConfigError("trainer memory needs trainer.devices as a number and a Llama preset model")
    world = trainer_args["devices"] * trainer_args["num_nodes"]
    try:
        strategy = build_strategy(name, processes=world, **strategy_args)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"strategy: {err}") from err
    if not callable(getattr(strategy, "shard", None)) or getattr(strategy, "zero_stage", 1) < 2:
        raise ConfigError(
            f"trainer memory plans sharded layouts; strategy {name!r} is not one (allowed: fsdp with zero_stage 2 "
            "or 3, parallel3d)"
        )
    strategy.precision = Precision(trainer_args["precision"])
    llama = build_llama_config(config["model"])
    try:
        reports = plan_memory(strategy, lambda: CausalLM(llama), world)
    except ValueError as err:
        raise ConfigError(f"strategy: {err}") from err
    dims = strategy.parallel_dims().resolve(world)
    head = (
        f"{llama.n_layers}-layer Llama, {world} GPUs as {dims}, precision "
        f"{trainer_args['precision']} (fp32 master weights unless '-true'); weights, gradients and AdamW state:"
    )
    try:
        layout = layout_of(
            strategy,
            world,
            trainer_args["precision"],
            trainer_args.get("activation_checkpointing"),
            config["model"]["loss_chunk_tokens"],
        )
        micro = _micro_batch(config["data"], trainer_args, dims.dp_replicate * dims.dp_shard)
        stages = per_stage_memory(shape_of(llama), layout, RunShape(micro, config["data"]["seq_len"]))
    except ValueError as err:
        raise ConfigError(f"strategy: {err}") from err
    peaks = [
        f"peak of pp rank {s.stage} with activations ({micro} x {config['data']['seq_len']} tokens a micro-batch, "
        f"activation checkpointing {layout.activation_checkpointing}): {s.line()}"
        for s in stages
    ]
    return "\n".join([head, *(r.line() for r in reports), *peaks])


def _micro_batch(data: dict[str, Any], trainer_args: dict[str, Any], readers: int) -> int:
    """data.batch_size, or data.global_batch_size split exactly over the `readers` (the ranks that read
    different data: the mesh's batch group, not the process count) and the accumulation steps."""
    total = data["global_batch_size"]
    if total is None:
        return data["batch_size"]
    accumulate = trainer_args["accumulate_grad_batches"]
    if total % (readers * accumulate):
        raise ConfigError(
            f"data.global_batch_size={total} does not divide by {readers} data-parallel ranks x "
            f"accumulate_grad_batches={accumulate}; allowed: a multiple of {readers * accumulate}"
        )
    return total // (readers * accumulate)


def _planned(config: dict[str, Any]) -> dict[str, Any]:
    """`strategy: auto` of a Llama recipe over more than one process: the layout `trainer plan` would choose
    for this world and hardware (trainer/config/plan_inputs.py), logged; other recipes keep the registry's
    "auto" (single for one process, else DDP)."""
    from trainer import flags
    from trainer.config.plan_inputs import auto_layout, local_hardware
    from trainer.core.logging import rank_zero_info

    trainer_args, model = config["trainer"], config["model"]
    world = _processes(trainer_args)
    if world == 1 or model["class_path"] is not None or model["hf"] is not None:
        return config
    accelerator = flags.resolve_accelerator(trainer_args["accelerator"])
    per_node = flags.resolve_devices(trainer_args["devices"], accelerator)
    planned, line = auto_layout(config, world, local_hardware(accelerator, per_node))
    rank_zero_info(line)
    return planned


def _processes(trainer_args: dict[str, Any]) -> int:
    """How many processes the run will have (for strategy 'auto')."""
    from trainer import flags

    accelerator = flags.resolve_accelerator(trainer_args["accelerator"])
    return flags.resolve_devices(trainer_args["devices"], accelerator) * trainer_args["num_nodes"]


def _instantiate(entry: dict[str, Any], where: str) -> Any:
    """Build a callback or logger; a bad argument's error names the list entry and the class."""
    try:
        return import_path(entry["class_path"], where)(**entry["init_args"])
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where} ({entry['class_path']}): {err}") from err
