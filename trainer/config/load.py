"""A recipe YAML loaded: `key.path=value` overrides applied, every section checked (keys, types, ranges,
the model's shape, the strategy and components named) and resolved to plain data with defaults filled in."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from trainer.config.checks import (
    check_init_args,
    check_ranges,
    check_type,
    import_path,
    reject_unknown,
    to_dataclass,
)
from trainer.config.schema import (
    MODEL_RANGES,
    MOE_RANGES,
    NEW_HF,
    NOT_LLAMA,
    OPTIMIZER_RANGES,
    SECTIONS,
    ConfigError,
    DataSection,
    ModelSection,
    OptimizerSection,
    trainer_section,
)
from trainer.models.hf import TASKS
from trainer.models.llama import LlamaConfig


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
        from trainer.core.logging import rank_zero_info

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
    reject_unknown(raw, SECTIONS, "recipe")
    trainer_cls = trainer_section()
    out = {
        "model": to_dataclass(ModelSection, raw.get("model") or {}, "model"),
        "data": to_dataclass(DataSection, raw.get("data") or {}, "data"),
        "optimizer": to_dataclass(OptimizerSection, raw.get("optimizer") or {}, "optimizer"),
        "trainer": to_dataclass(trainer_cls, raw.get("trainer") or {}, "trainer"),
    }
    resolved = {name: dataclasses.asdict(section) for name, section in out.items()}
    resolved["strategy"] = _check_strategy(raw.get("strategy") or {"name": "auto"})
    resolved["callbacks"] = [
        _check_component(c, f"callbacks[{i}]", "callbacks") for i, c in enumerate(raw.get("callbacks") or [])
    ]
    resolved["loggers"] = [
        _check_component(c, f"loggers[{i}]", "loggers") for i, c in enumerate(raw.get("loggers") or [])
    ]
    if raw.get("fault_tolerance") is not None:  # optional: a recipe without it resolves as before
        resolved["fault_tolerance"] = _check_fault_tolerance(raw["fault_tolerance"])
    model = resolved["model"]
    check_ranges(model, MODEL_RANGES, "model")
    if model["task"] not in TASKS:
        raise ConfigError(f"model.task={model['task']!r} is unknown; allowed: {', '.join(TASKS)}")
    check_ranges(resolved["optimizer"], OPTIMIZER_RANGES, "optimizer")
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


def _check_fault_tolerance(section: Any) -> dict[str, Any]:
    """`fault_tolerance:` (absent or null: none): FaultTolerance's fields, checked by building one."""
    from trainer.fault_tolerance import FaultTolerance

    if not isinstance(section, dict):
        raise ConfigError(f"fault_tolerance must be a mapping of FaultTolerance fields; got {section!r}")
    fields = dataclasses.fields(FaultTolerance)
    reject_unknown(section, [f.name for f in fields], "fault_tolerance")
    required = [f.name for f in fields if f.default is dataclasses.MISSING]
    missing = [f"fault_tolerance.{name}" for name in required if name not in section]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} not set; allowed: the lighthouse's host:port and this group's index, or the "
            "recipe run by `trainer replicas`, which sets them"
        )
    try:
        return dataclasses.asdict(FaultTolerance(**section))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"fault_tolerance: {err}") from err


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
    overrides = {k: v for k, v in model.items() if k not in NOT_LLAMA and v is not None}
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
        reject_unknown(moe, list(hints), "model.moe")
        moe = {key: check_type(value, hints[key], f"model.moe.{key}") for key, value in moe.items()}
        check_ranges(moe, MOE_RANGES, "model.moe")
        return dataclasses.replace(config, moe=dataclasses.replace(config.moe, **moe))
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model: {err}") from err


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
    from trainer.loggers import LOGGERS, Logger

    if isinstance(entry, str):
        if kind == "loggers" and entry in LOGGERS:
            return {"class_path": f"trainer.loggers.{LOGGERS[entry].__name__}", "init_args": {}}
        entry = {"class_path": entry}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a name or {{class_path: ..., init_args: {{...}}}}; got {entry!r}")
    reject_unknown(entry, ("class_path", "init_args"), where)
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
