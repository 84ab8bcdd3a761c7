"""The generic checks of a recipe's keys and values: unknown keys named with the closest valid one, values
converted to their field's type or refused naming the key, the type and the value, number ranges, and the
import of a 'package.module.Name' with its constructor arguments checked."""

from __future__ import annotations

import difflib
import importlib
import inspect
import types
import typing
from typing import Any, Union

from trainer.config.schema import ConfigError


def check_ranges(section: dict[str, Any], ranges: dict[str, tuple[float, bool]], where: str) -> None:
    """Every set field of `ranges` at least its minimum (above it when strict), else a one-line error."""
    for name, (minimum, strict) in ranges.items():
        value = section.get(name)
        if value is None or (value > minimum or (value == minimum and not strict)):
            continue
        kind = "an int" if isinstance(value, int) else "a number"
        raise ConfigError(
            f"{where}.{name}={value!r} is invalid; allowed: {kind} {'>' if strict else '>='} {minimum}"
        )


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
    reject_unknown(args, [n for n in params if n != "self"], where)


def to_dataclass(cls: type, data: Any, where: str) -> Any:
    """The section `cls` built from the mapping `data`, each key known and each value of its field's type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of keys; got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    reject_unknown(data, list(hints), where)
    return cls(**{key: check_type(value, hints[key], f"{where}.{key}") for key, value in data.items()})


def reject_unknown(data: dict[str, Any], allowed: Any, where: str) -> None:
    """A key of `data` not in `allowed` is an error naming the closest allowed one (or all of them)."""
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


def check_type(value: Any, tp: Any, where: str) -> Any:
    """`value` as type `tp` (ints accepted as floats, '1e-3' strings as numbers), or a ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return check_type(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where} expects {_type_name(tp)}; got {type(value).__name__} {value!r}")
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} expects {_type_name(tp)}; got {type(value).__name__} {value!r}")
        inner = args[0] if args else Any
        return [check_type(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
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
    """`tp` as a recipe writer reads it: "int or null", "a list of float", ..."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (Union, types.UnionType):
        names = " or ".join(_type_name(a) for a in args)
        return names + (" or null" if len(args) < len(typing.get_args(tp)) else "")
    if typing.get_origin(tp) in (list, tuple):
        return f"a list of {_type_name(args[0])}" if args else "a list"
    return {int: "int", float: "float", str: "str", bool: "bool (true/false)", dict: "a mapping"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )
