"""Recipe YAML -> typed sections -> objects, with one-line errors for bad keys, types and paths.

A recipe reads like a description of the run; its sections are `model`, `data`, `optimizer`,
`trainer`, `strategy`, `callbacks` and `loggers`. Every key is checked against the dataclass (or
signature) it configures: an unknown key names the closest valid one, a wrong type names the key,
the expected type and the value given. `key.path=value` overrides go through the same checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import types
import typing
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, Union

import yaml

from trainer.models.hf import TASKS
from trainer.models.llama import LlamaConfig


class ConfigError(ValueError):
    """A recipe or override that cannot describe a run."""


# ---- sections ------------------------------------------------------------------------------------
ModelSection = make_dataclass(
    "ModelSection",
    [
        ("preset", str, field(default="tiny")),
        ("class_path", str | None, field(default=None)),
        ("init_args", dict, field(default_factory=dict)),
        ("hf", str | None, field(default=None)),
        ("task", str, field(default="causal-lm")),
        ("num_labels", int | None, field(default=None)),
        ("freeze", list[str], field(default_factory=list)),
        ("lora", dict | None, field(default=None)),
        ("hf_config", dict | None, field(default=None)),
        ("loss_chunk_tokens", int | None, field(default=None)),
    ]
    + [
        # model.moe: a mapping of MoEConfig fields that override the MoE preset's (build_llama_config)
        (name, (dict if name == "moe" else tp) | None, field(default=None))
        for name, tp in typing.get_type_hints(LlamaConfig).items()
    ],
)
ModelSection.__doc__ = (
    "A Llama `preset` with any LlamaConfig field overridden, or `class_path` (a TrainModule, or an nn.Module "
    "mapping tokens to logits) built with `init_args`, or `hf`: a local Hugging Face model directory (or "
    "'py:package.function' returning one) fine-tuned for `task` (trainer.models.hf.HFModule, with `num_labels`, "
    "`freeze` patterns and `lora` options); `moe` overrides fields of a MoE preset's MoEConfig; `hf: 'new:PATH'` "
    "with `hf_config` (a transformers LlamaConfig's fields) first creates PATH, when missing, with a new model of "
    "that config and a byte-level tokenizer. "
    "`loss_chunk_tokens`: CausalLM's fused output projection and loss over chunks of that many tokens."
)
_NOT_LLAMA = (
    "preset", "class_path", "init_args", "hf", "task", "num_labels", "freeze", "lora", "hf_config",
    "loss_chunk_tokens",
)  # fmt: skip


@dataclass
class DataSection:
    """Arguments of trainer.data.lm_dataloaders; `path` None is the embedded corpus. `global_batch_size`
    (samples per optimizer step over all processes) replaces `batch_size` when set."""

    path: str | None = None
    val_path: str | None = None  # Hugging Face models: a separate validation file (else val_fraction of path)
    tokenizer: str = "byte"
    seq_len: int = 256
    batch_size: int = 8  # per process and micro-batch
    global_batch_size: int | None = None  # if set: batch_size = this / (processes x accumulation), exactly
    val_fraction: float = 0.05
    text_field: str = "text"
    cache_dir: str | None = None
    prompt_field: str | None = None  # Hugging Face SFT: loss on the response tokens only
    response_field: str | None = None
    messages_field: str | None = None  # chat records, formatted with the tokenizer's chat template
    label_field: str = "label"  # classification
    packing: bool = True  # causal-lm plain text: packed windows (else padded per batch)


@dataclass
class OptimizerSection:
    """AdamW of CausalLM."""

    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    eps: float = 1e-8


def _trainer_section() -> type:
    """Every Trainer flag but strategy/callbacks/loggers (sections of their own), with its type and default."""
    from trainer.trainer import Trainer

    hints = typing.get_type_hints(Trainer.__init__)
    specs = []
    for name, param in inspect.signature(Trainer.__init__).parameters.items():
        if name in ("self", "strategy", "callbacks", "loggers"):
            continue
        default = str(param.default) if isinstance(param.default, Path) else param.default
        tp = str | None if name == "default_root_dir" else hints[name]
        specs.append((name, tp, field(default=default)))
    return make_dataclass("TrainerSection", specs)


SECTIONS = ("model", "data", "optimizer", "trainer", "strategy", "callbacks", "loggers")
CLASSIFY = ("seq-classification", "token-classification")  # the tasks whose labels may be class names
NEW_HF = "new:"  # model.hf: 'new:PATH' creates a new model of model.hf_config at PATH when it is missing

# The smallest value of each number field of the model and optimizer sections: (minimum, strict), strict
# meaning the minimum itself is refused. Checked here, as a 0 or a negative fails later in a traceback.
_AT_LEAST_1, _POSITIVE, _NON_NEGATIVE = (1, False), (0, True), (0, False)
_MODEL_RANGES = {
    **dict.fromkeys(
        ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "multiple_of", "max_seq_len"),
        _AT_LEAST_1,
    ),
    **dict.fromkeys(("ffn_dim_multiplier", "norm_eps", "rope_theta", "init_std"), _POSITIVE),
    "num_labels": _AT_LEAST_1,
    "loss_chunk_tokens": _AT_LEAST_1,
}  # fmt: skip
_MOE_RANGES = {
    **dict.fromkeys(("n_experts", "top_k", "moe_ffn_dim", "moe_every"), _AT_LEAST_1),
    **dict.fromkeys(("n_shared_experts", "n_dense_layers"), _NON_NEGATIVE),
    **dict.fromkeys(("aux_loss_coef", "z_loss_coef", "bias_update_rate"), _NON_NEGATIVE),
    "capacity_factor": _POSITIVE,
}
_OPTIMIZER_RANGES = {"lr": _POSITIVE, "weight_decay": _NON_NEGATIVE, "eps": _POSITIVE}


# ---- loading -------------------------------------------------------------------------------------
def load_recipe(path: str | Path, overrides: list[str] = ()) -> dict[str, Any]:
    """The recipe at `path` with `key.path=value` overrides applied, fully resolved and type-checked."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"recipe '{path}' does not exist; allowed: a YAML file such as recipes/llama_tiny.yaml"
        )
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe '{path}' is not valid YAML: {str(err).splitlines()[0]}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe '{path}' must be a mapping of sections ({', '.join(SECTIONS)})")
    recipe_steps = (
        (raw.get("trainer") or {}).get("max_steps") if isinstance(raw.get("trainer"), dict) else None
    )
    for item in overrides:
        apply_override(raw, item)
    resolved = resolve(raw)
    keys = {item.split("=", 1)[0].strip() for item in overrides}
    _fit_warmup(resolved["trainer"], recipe_steps, keys)
    return resolved


def _fit_warmup(trainer: dict[str, Any], recipe_steps: Any, overridden: set[str]) -> None:
    """A warmup too long for the run's trainer.max_steps: scaled down with a note when max_steps alone came
    from the command line (a short trial run of a longer recipe), keeping the recipe's warmup / max_steps
    ratio; else an error naming the override that fixes it."""
    steps, warmup = trainer["max_steps"], trainer["warmup_steps"]
    if (
        trainer["lr_schedule"] == "constant"
        or not isinstance(steps, int)
        or not isinstance(warmup, int)
        or not 1 <= steps <= warmup
    ):
        return  # fits, or a bad value the Trainer names
    shortened = "trainer.max_steps" in overridden and "trainer.warmup_steps" not in overridden
    if shortened and isinstance(recipe_steps, int) and warmup < recipe_steps:
        trainer["warmup_steps"] = warmup * steps // recipe_steps
        from trainer.logging import rank_zero_info

        rank_zero_info(
            f"trainer.warmup_steps {warmup} -> {trainer['warmup_steps']}: the recipe's {warmup} of "
            f"{recipe_steps} steps, scaled to trainer.max_steps={steps} (set trainer.warmup_steps to choose)"
        )
        return
    raise ConfigError(
        f"trainer.warmup_steps={warmup} leaves no room to decay in {steps} total steps (trainer.max_steps); "
        f"allowed: warmup_steps < max_steps, e.g. the override trainer.warmup_steps={steps // 10}"
    )


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in the raw recipe (value parsed as YAML: 3, 1e-3, true, null, [1, 2])."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key.path=value")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r} has an empty key part")
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part, {}), dict):
            raise ConfigError(f"override {key}: '{part}' is not a section")
        node = node.setdefault(part, {})
    node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""


def resolve(raw: dict[str, Any]) -> dict[str, Any]:
    """Check every section; returns plain data (the resolved config), defaults filled in."""
    _reject_unknown(raw, SECTIONS, "recipe")
    trainer_cls = _trainer_section()
    out = {
        "model": _to_dataclass(ModelSection, raw.get("model") or {}, "model"),
        "data": _to_dataclass(DataSection, raw.get("data") or {}, "data"),
        "optimizer": _to_dataclass(OptimizerSection, raw.get("optimizer") or {}, "optimizer"),
        "trainer": _to_dataclass(trainer_cls, raw.get("trainer") or {}, "trainer"),
    }
    resolved = {name: dataclasses.asdict(section) for name, section in out.items()}
    resolved["strategy"] = _check_strategy(raw.get("strategy") or {"name": "auto"})
    resolved["callbacks"] = [
        _check_component(c, f"callbacks[{i}]", "callbacks") for i, c in enumerate(raw.get("callbacks") or [])
    ]
    resolved["loggers"] = [
        _check_component(c, f"loggers[{i}]", "loggers") for i, c in enumerate(raw.get("loggers") or [])
    ]
    model = resolved["model"]
    _check_ranges(model, _MODEL_RANGES, "model")
    if model["task"] not in TASKS:
        raise ConfigError(f"model.task={model['task']!r} is unknown; allowed: {', '.join(TASKS)}")
    _check_ranges(resolved["optimizer"], _OPTIMIZER_RANGES, "optimizer")
    _check_betas(resolved["optimizer"]["betas"])
    if model["class_path"] is not None and model["hf"] is not None:
        raise ConfigError("model.class_path and model.hf are both set; allowed: one of the two")
    if model["class_path"] is None and model["hf"] is None:
        build_llama_config(model)  # shape errors now, not after start-up
    chunk = model["loss_chunk_tokens"]
    if chunk is not None and model["hf"] is not None:
        raise ConfigError(
            f"model.loss_chunk_tokens={chunk!r}: allowed: an int >= 1 (tokens per chunk of CausalLM's fused "
            "output projection and loss), with a Llama preset or a class_path model, or null (the plain loss)"
        )
    if model["hf"] is not None:
        _check_hf_source(model)
    return resolved


def _check_ranges(section: dict[str, Any], ranges: dict[str, tuple[float, bool]], where: str) -> None:
    """Every set field of `ranges` at least its minimum (above it when strict), else a one-line error."""
    for name, (minimum, strict) in ranges.items():
        value = section.get(name)
        if value is None or (value > minimum or (value == minimum and not strict)):
            continue
        kind = "an int" if isinstance(value, int) else "a number"
        raise ConfigError(
            f"{where}.{name}={value!r} is invalid; allowed: {kind} {'>' if strict else '>='} {minimum}"
        )


def _check_betas(betas: list[float]) -> None:
    """AdamW's two decay rates, each in [0, 1)."""
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError(
            f"optimizer.betas={betas!r} is invalid; allowed: two numbers in [0, 1), e.g. [0.9, 0.95]"
        )


def _check_hf_source(model: dict[str, Any]) -> None:
    """model.hf names an existing folder, a 'py:' function, or 'new:PATH' with the hf_config to create."""
    hf = model["hf"]
    if hf.startswith(NEW_HF):
        if model["hf_config"] is None or not hf[len(NEW_HF) :]:
            raise ConfigError(
                f"model.hf={hf!r} creates a new model but needs a path and model.hf_config; allowed: "
                "'new:PATH' with model.hf_config (a transformers LlamaConfig's fields), or an existing model folder"
            )
        return
    if not hf.startswith("py:") and not Path(hf).is_dir():
        raise ConfigError(
            f"model.hf={hf!r} is not a directory; allowed: a local Hugging Face model folder (save_pretrained), "
            f"'py:package.function' returning one, or 'new:{hf}' with model.hf_config to create a new model there"
        )


def build_llama_config(model: dict[str, Any]) -> LlamaConfig:
    """The preset with the recipe's fields; `moe` (a mapping) overrides fields of a MoE preset's router."""
    overrides = {k: v for k, v in model.items() if k not in _NOT_LLAMA and v is not None}
    moe = overrides.pop("moe", None)
    try:
        config = LlamaConfig.preset(model["preset"], **overrides)
        if moe is None:
            return config
        if not isinstance(moe, dict) or config.moe is None:
            raise ConfigError(
                f"model.moe={moe!r}: allowed: a mapping of MoEConfig fields, on a MoE preset "
                f"(model.preset {model['preset']!r} is {'MoE' if config.moe else 'dense'})"
            )
        hints = typing.get_type_hints(type(config.moe))
        _reject_unknown(moe, list(hints), "model.moe")
        moe = {key: _check_type(value, hints[key], f"model.moe.{key}") for key, value in moe.items()}
        _check_ranges(moe, _MOE_RANGES, "model.moe")
        return dataclasses.replace(config, moe=dataclasses.replace(config.moe, **moe))
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model: {err}") from err


def import_path(path: str, where: str) -> Any:
    """The object named by 'package.module.Name'."""
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(
            f"{where}: cannot import {path!r} ({err}); allowed: an importable 'package.module.Name'"
        ) from err


def check_init_args(cls: Any, args: dict[str, Any], where: str) -> None:
    """Unknown constructor arguments are named with the closest valid one."""
    params = inspect.signature(cls).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    _reject_unknown(args, [n for n in params if n != "self"], where)


# ---- checks --------------------------------------------------------------------------------------
def _to_dataclass(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of keys; got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    _reject_unknown(data, list(hints), where)
    return cls(**{key: _check_type(value, hints[key], f"{where}.{key}") for key, value in data.items()})


def _reject_unknown(data: dict[str, Any], allowed: Any, where: str) -> None:
    allowed = list(allowed)
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; allowed: {', '.join(allowed)}"
            raise ConfigError(
                f"unknown key '{where}.{key}'{hint}"
                if where != "recipe"
                else f"unknown section '{key}'{hint}"
            )


def _check_type(value: Any, tp: Any, where: str) -> Any:
    """`value` as type `tp` (ints accepted as floats, '1e-3' strings as numbers), or a ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _check_type(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where} expects {_type_name(tp)}; got {type(value).__name__} {value!r}")
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} expects {_type_name(tp)}; got {type(value).__name__} {value!r}")
        inner = args[0] if args else Any
        return [_check_type(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where} expects {_type_name(tp)}; got {type(value).__name__} {value!r}")


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (Union, types.UnionType):
        names = " or ".join(_type_name(a) for a in args)
        return names + (" or null" if len(args) < len(typing.get_args(tp)) else "")
    if typing.get_origin(tp) in (list, tuple):
        return f"a list of {_type_name(args[0])}" if args else "a list"
    return {int: "int", float: "float", str: "str", bool: "bool (true/false)", dict: "a mapping"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _check_strategy(data: Any) -> dict[str, Any]:
    from strategies.registry import NAMES, STRATEGIES

    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, dict):
        raise ConfigError(f"strategy must be a name or a mapping with 'name'; got {data!r}")
    name = data.get("name", "auto")
    if name not in NAMES:
        close = difflib.get_close_matches(str(name), list(NAMES), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"strategy.name={name!r} is unknown; {hint}allowed: {', '.join(NAMES)}")
    args = {k: v for k, v in data.items() if k != "name"}
    if name == "auto" and args:
        raise ConfigError(
            f"strategy 'auto' takes no arguments (got {', '.join(args)}); name the strategy to configure it"
        )
    if name != "auto":
        check_init_args(STRATEGIES[name], args, "strategy")
    return {"name": name, **args}


def _check_component(entry: Any, where: str, kind: str) -> dict[str, Any]:
    """A callback/logger entry as {class_path, init_args}; the class is imported and its args checked."""
    from callbacks.base import Callback
    from trainer.logging import LOGGERS, Logger

    if isinstance(entry, str):
        if kind == "loggers" and entry in LOGGERS:
            return {"class_path": f"trainer.logging.{LOGGERS[entry].__name__}", "init_args": {}}
        entry = {"class_path": entry}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a name or {{class_path: ..., init_args: {{...}}}}; got {entry!r}")
    _reject_unknown(entry, ("class_path", "init_args"), where)
    if "class_path" not in entry:
        raise ConfigError(f"{where} needs a class_path (e.g. callbacks.ModelCheckpoint)")
    cls = import_path(entry["class_path"], where)
    base = Callback if kind == "callbacks" else Logger
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{where}: {entry['class_path']} is not a {base.__name__} subclass")
    args = entry.get("init_args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"{where}.init_args must be a mapping; got {args!r}")
    check_init_args(cls, args, f"{where}.init_args")
    return {"class_path": entry["class_path"], "init_args": args}


# ---- objects -------------------------------------------------------------------------------------
def build_run(config: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """(trainer, module, train_loader, val_loader) described by a resolved config; the Trainer (whose
    flags are checked on construction) comes first so a bad flag fails before data is read."""
    import torch

    from strategies.registry import build_strategy
    from trainer.data import lm_dataloaders
    from trainer.models.causal_lm import CausalLM
    from trainer.module import TrainModule
    from trainer.trainer import Trainer

    model, data, optim = config["model"], config["data"], config["optimizer"]
    trainer_args, strategy = dict(config["trainer"]), dict(config["strategy"])
    try:
        built_strategy = build_strategy(strategy.pop("name"), processes=_processes(trainer_args), **strategy)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"strategy: {err}") from err
    callbacks = [_instantiate(c, f"callbacks[{i}]") for i, c in enumerate(config["callbacks"])]
    loggers = [_instantiate(c, f"loggers[{i}]") for i, c in enumerate(config["loggers"])]
    try:
        trainer = Trainer(strategy=built_strategy, callbacks=callbacks, loggers=loggers, **trainer_args)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"trainer: {err}") from err
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


def _build_hf(
    model: dict[str, Any], data: dict[str, Any], optim: dict[str, Any], batch_size: int, seed: int
) -> tuple[Any, Any, Any]:
    """An HFModule and its loaders (trainer.data.hf_data) for a recipe whose model is `hf`."""
    from trainer.data.hf_data import class_names, hf_dataloaders, load_hf_dataset
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
            lora=model["lora"], labels=names,
        )  # fmt: skip
        train_loader, val_loader = hf_dataloaders(
            source, module.tokenizer, model["task"], seq_len=data["seq_len"], batch_size=batch_size,
            val_fraction=data["val_fraction"], seed=seed, text_field=data["text_field"],
            prompt_field=data["prompt_field"], response_field=data["response_field"],
            messages_field=data["messages_field"], label_field=data["label_field"], packing=data["packing"],
            cache_dir=data["cache_dir"], labels=names,
        )  # fmt: skip
    except (ValueError, FileNotFoundError, ImportError) as err:
        raise ConfigError(f"model.hf: {err}") from err
    return module, train_loader, val_loader


def memory_lines(config: dict[str, Any]) -> str:
    """Per-GPU weights, gradients and AdamW state of a resolved Llama recipe under its sharding
    strategy, one line per pipeline stage (strategies/memory_plan.py), without any GPU or process."""
    from strategies.memory_plan import plan_memory
    from strategies.registry import build_strategy
    from trainer.models.causal_lm import CausalLM
    from trainer.precision import Precision

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
    head = (
        f"{llama.n_layers}-layer Llama, {world} GPUs as {strategy.parallel_dims().resolve(world)}, precision "
        f"{trainer_args['precision']} (fp32 master weights unless '-true'); activations not included:"
    )
    return "\n".join([head, *(r.line() for r in reports)])


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
