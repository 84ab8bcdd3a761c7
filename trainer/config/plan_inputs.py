"""A resolved recipe as the planner sees it (its ModelShape, sequence length, global batch and precision),
and a planned layout back as recipe overrides: what `trainer plan` prints and `strategy: auto` applies."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from trainer.config.load import build_llama_config
from trainer.config.schema import ConfigError

# the strategy keys a plan decides: a recipe's other strategy keys (reduce_dtype, async_save, ...) are kept
# when the planned strategy takes them
PLANNED_KEYS = (
    "dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "sequence_parallel", "zero_stage", "replicate",
    "activation_checkpointing", "pp_schedule", "microbatches",
)  # fmt: skip


@dataclass(frozen=True)
class PlanInputs:
    """What the planner needs of a recipe."""

    shape: Any  # strategies.plan.shapes.ModelShape
    seq_len: int
    global_batch: int  # sequences per optimizer step over the world
    precision: str  # "bf16" or "fp32"
    optimizer: str = "adamw"


def plan_inputs(config: dict[str, Any], world: int | None = None) -> PlanInputs:
    """The planner's view of a resolved Llama recipe; the global batch is data.global_batch_size, else
    batch_size x the recipe's processes (`world`, default devices x num_nodes) x accumulation."""
    from strategies.plan.model_shape import shape_of

    model, data, trainer = config["model"], config["data"], config["trainer"]
    if model["class_path"] is not None or model["hf"] is not None:
        raise ConfigError(
            "trainer plan needs a Llama preset model (model.preset); allowed: a recipe without "
            "model.class_path or model.hf"
        )
    llama = build_llama_config(model)
    shape = shape_of(llama)  # the memory model's reading too: MoE blocks, dense first layers included
    global_batch = data["global_batch_size"]
    if global_batch is None:
        if world is None:
            from trainer import flags

            given = trainer["devices"]
            try:
                if isinstance(given, (list, tuple)) or (
                    isinstance(given, int) and not isinstance(given, bool) and given >= 1
                ):
                    # the recipe's own count: a plan reads it on any host, also one without those GPUs
                    devices = len(given) if isinstance(given, (list, tuple)) else given
                else:  # "auto" or -1: what this host has
                    devices = flags.resolve_devices(given, flags.resolve_accelerator(trainer["accelerator"]))
            except ValueError as err:
                raise ConfigError(f"trainer: {err}") from err
            world = devices * trainer["num_nodes"]
        global_batch = data["batch_size"] * world * trainer["accumulate_grad_batches"]
    precision = "bf16" if str(trainer["precision"]).startswith("bf16") else "fp32"
    return PlanInputs(shape, data["seq_len"], global_batch, precision)


def layout_overrides(config: dict[str, Any], layout: Any, run: Any, global_batch: int) -> dict[str, Any]:
    """The recipe keys (dotted) that run `layout`: the strategy's name and planned arguments, the global
    batch and the accumulation that split it as planned (trainer.activation_checkpointing where the
    strategy takes none)."""
    from strategies.registry import layout_spec

    spec = layout_spec(layout)
    out: dict[str, Any] = {f"strategy.{k}": v for k, v in spec.items() if k != "activation_checkpointing"}
    if "activation_checkpointing" in spec:  # in one place: the Trainer flag must then be unset or agree
        out["strategy.activation_checkpointing"] = spec["activation_checkpointing"]
        out["trainer.activation_checkpointing"] = None
    else:
        ac = layout.activation_checkpointing
        out["trainer.activation_checkpointing"] = None if ac == "none" else ac
    out["data.global_batch_size"] = global_batch
    out["trainer.accumulate_grad_batches"] = run.accumulation
    return out


def apply_layout(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of the resolved `config` with the planned `overrides`: the strategy section replaced by the
    planned one, keeping the recipe's other strategy keys the planned strategy takes."""
    from strategies.registry import STRATEGIES
    from trainer.config.checks import check_init_args

    out = copy.deepcopy(config)
    strategy = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("strategy.")}
    cls = STRATEGIES[strategy["name"]]
    kept = {k: v for k, v in config["strategy"].items() if k not in ("name", *PLANNED_KEYS)}
    try:
        check_init_args(cls, kept, "strategy")
    except ConfigError:
        kept = {}  # the recipe's keys belong to another strategy: the planned one's defaults instead
    out["strategy"] = {**strategy, **kept}
    for key, value in overrides.items():
        section, name = key.split(".", 1)
        if section != "strategy":
            out[section][name] = value
    return out


def override_args(config: dict[str, Any], overrides: dict[str, Any]) -> list[str]:
    """`key=value` command-line overrides for `overrides`; when the recipe's strategy section holds keys the
    planned strategy does not take (dotted keys cannot remove them), one `strategy={...}` mapping instead."""
    import shlex

    import yaml

    def text(value: Any) -> str:
        return (
            yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 20)
            .strip()
            .removesuffix("...")
            .strip()
        )

    planned = apply_layout(config, overrides)["strategy"]
    stale = [k for k in config["strategy"] if k != "name" and k not in planned]
    items = [(k, v) for k, v in overrides.items() if not (stale and k.startswith("strategy."))]
    args = [shlex.quote(f"{key}={text(value)}") for key, value in items]
    if stale:
        args.insert(0, shlex.quote(f"strategy={text(planned)}"))
    return args


def plan_for(
    config: dict[str, Any],
    world: int,
    hardware: Any,
    memory: Any = None,
    recipe_world: int | None = None,
    keep: Any = None,
) -> tuple[Any, PlanInputs]:
    """The ranked layouts (strategies.plan.search.Plan) of a resolved recipe over `world` devices of
    `hardware`, its global batch that of `recipe_world` processes (default: the recipe's), those `keep`
    (strategies.plan.keep.Keep) pins only; a ConfigError naming the problem when none fits."""
    from strategies.plan.search import layouts, search

    inputs = plan_inputs(config, recipe_world)
    try:
        plan = search(
            inputs.shape, hardware, world, inputs.seq_len, inputs.global_batch, inputs.precision,
            inputs.optimizer, memory=memory, keep=keep,
        )  # fmt: skip
    except ValueError as err:
        # a pin the search never weighs is named, rather than what nothing fitting would say
        pinned = keep.unweighed(layouts(
            inputs.shape, world, hardware.gpus_per_node, inputs.seq_len, inputs.global_batch,
            inputs.precision, inputs.optimizer,
        )) if keep is not None else None  # fmt: skip
        raise ConfigError(pinned or f"plan{f' --keep {keep}' if keep else ''}: {err}") from err
    return plan, inputs


def recipe_layout(config: dict[str, Any], world: int, inputs: PlanInputs) -> tuple[Any, Any]:
    """The Layout and RunShape the recipe's strategy section runs over `world` processes with the planned
    global batch (the recipe's accumulation, the rest per micro-batch); a one-line ValueError naming the
    first constraint it breaks there (the strategy's own checks before any process starts)."""
    from strategies.plan.from_strategy import layout_of
    from strategies.plan.shapes import Layout, RunShape
    from strategies.registry import build_strategy
    from trainer.models.causal_lm import CausalLM

    trainer, args = config["trainer"], dict(config["strategy"])
    name = args.pop("name")
    try:
        strategy = build_strategy(name, processes=world, **args)
    except TypeError as err:
        raise ValueError(f"strategy: {err}") from err
    ac, chunk = trainer["activation_checkpointing"], config["model"]["loss_chunk_tokens"]
    if name == "single":
        if world != 1:
            raise ValueError(f"strategy 'single' runs one process, not {world}; allowed: --gpus 1")
        layout = Layout(
            activation_checkpointing=ac or "none", loss_chunk_tokens=chunk, precision=inputs.precision
        )
    elif getattr(strategy, "options", None) is None:  # not a ParallelStrategy preset (dp_sgd)
        raise ValueError(f"strategy {name!r} is not in the planner's models; allowed: ddp, fsdp, parallel3d")
    else:
        strategy.devices, strategy.num_nodes = world, 1  # the world DDP's replicas span
        layout = layout_of(strategy, world, str(trainer["precision"]), ac, chunk)
    strategy.check_module(CausalLM(build_llama_config(config["model"])))  # built late: only its shape is read
    readers, accumulation = layout.dp_replicate * layout.dp_shard, trainer["accumulate_grad_batches"]
    if inputs.global_batch % (readers * accumulation):
        raise ValueError(
            f"the global batch of {inputs.global_batch} sequences does not split over {readers} data-parallel "
            f"ranks x accumulate_grad_batches={accumulation}; allowed: a multiple of {readers * accumulation}"
        )
    micro = inputs.global_batch // (readers * accumulation)
    strategy.check_batch(micro, inputs.seq_len)
    return layout, RunShape(micro, inputs.seq_len, inputs.optimizer, accumulation=accumulation)


def local_hardware(accelerator: str, devices_per_node: int) -> Any:
    """The hardware this process runs on, for `strategy: auto`: the CUDA device matched to the table by
    name (its memory as reported; an unknown one is planned as an H100) with InfiniBand between nodes,
    or CPU processes sharing the host's memory."""
    import os

    import torch

    from strategies.plan.hardware import DEVICES, build_hardware, cpu_hardware

    if accelerator == "cuda":
        name = torch.cuda.get_device_name(0).lower()
        device = next((key for key in DEVICES if key in name), "h100")
        memory = torch.cuda.get_device_properties(0).total_memory
        return build_hardware(device, devices_per_node, "ib-ndr", gpu_memory=memory)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return cpu_hardware(devices_per_node, host / devices_per_node)


def auto_layout(config: dict[str, Any], world: int, hardware: Any) -> tuple[dict[str, Any], str]:
    """`strategy: auto` of a Llama recipe over `world` processes: the recipe with the planned layout's
    overrides applied, and the line that says what was chosen and why."""
    from strategies.plan.search import layout_text, pass_size

    plan, inputs = plan_for(config, world, hardware, recipe_world=world)
    best = plan.best
    overrides = layout_overrides(config, best.layout, best.run, inputs.global_batch)
    line = (
        f"strategy auto: {layout_text(best.layout)} (micro-batch {pass_size(best)}) on {world} processes, "
        f"predicted {best.time.tokens_per_s:,.0f} tokens/s; {plan.why}; as overrides: "
        + " ".join(override_args(config, overrides))
    )
    return apply_layout(config, overrides), line
