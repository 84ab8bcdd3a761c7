"""Checks of Trainer flags: one-line errors naming the flag, the value and what is allowed."""

from __future__ import annotations

import datetime
from typing import Any

import torch


def check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")
    return value


def check_number(
    name: str, value: Any, minimum: float, *, strict: bool = False, allow_none: bool = False
) -> float | None:
    """A real number >= `minimum` (> with `strict`), or None when allowed."""
    if value is None and allow_none:
        return None
    numeric = not isinstance(value, bool) and isinstance(value, (int, float))
    if not numeric or value < minimum or (strict and value == minimum):
        allowed = f"a number {'>' if strict else '>='} {minimum:g}" + (" or None" if allow_none else "")
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")
    return float(value)


def check_limit(name: str, value: Any) -> int | float | None:
    """None (all), an int count >= 0, or a float fraction in [0, 1]."""
    if value is None:
        return None
    if isinstance(value, float) and 0.0 <= value <= 1.0:
        return None if value == 1.0 else value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"{name}={value!r} is invalid; allowed: None, an int >= 0, or a float in [0.0, 1.0]")


def check_val_interval(value: Any) -> int | float | None:
    """None (end of every epoch), an int of optimizer steps, or a float fraction of an epoch."""
    if value is None:
        return None
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(
        f"val_check_interval={value!r} is invalid; allowed: None, an int >= 1 (steps), or a float in (0, 1] (of an epoch)"
    )


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is unknown; allowed: {', '.join(map(repr, allowed))}")
    return value


def resolve_accelerator(value: Any) -> str:
    """The run's accelerator, "cpu" or "cuda", from "auto" (CUDA if available), "cpu", "cuda" or "gpu"
    (Lightning's name for "cuda")."""
    check_choice("accelerator", value, ("auto", "cpu", "cuda", "gpu"))
    if value == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if value in ("cuda", "gpu") and not torch.cuda.is_available():
        raise ValueError(
            f"accelerator={value!r} but no CUDA device is available; allowed here: 'cpu' or 'auto'"
        )
    return "cuda" if value == "gpu" else value


def resolve_devices(value: Any, accelerator: str) -> int:
    """Processes per node: an int, a list of GPU indices (one process each, see `check_device_ids`), or
    "auto" = what torchrun/SLURM started, else every GPU, else 1 on the CPU."""
    if value == "auto":
        from trainer.launch import detect_world

        world = detect_world()
        if world is not None:
            return world.local_world_size
        return torch.cuda.device_count() if accelerator == "cuda" else 1
    if isinstance(value, (list, tuple)):
        return len(check_device_ids(value, accelerator))
    if isinstance(value, str):
        raise ValueError(
            f"devices={value!r} is invalid; allowed: an int >= 1, a list of GPU indices or 'auto'"
        )
    return check_int("devices", value, 1)  # type: ignore[return-value]


def check_device_ids(value: list[Any] | tuple[Any, ...], accelerator: str) -> list[int]:
    """Lightning's `devices=[i, ...]`: distinct CUDA indices below the device count. A CPU run has no device
    indices (its "devices" are gloo processes), so a list there is an error rather than a count."""
    if accelerator != "cuda":
        raise ValueError(
            f"devices={list(value)!r} picks GPUs but accelerator={accelerator!r}; allowed on the CPU: an int >= 1 or 'auto'"
        )
    count = torch.cuda.device_count()
    valid = all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count for i in value)
    if not value or not valid or len(set(value)) != len(value):
        raise ValueError(
            f"devices={list(value)!r} is invalid; allowed: a non-empty list of distinct GPU indices in 0..{count - 1}"
        )
    return list(value)


def device_for(accelerator: str, device_ids: list[int] | None, local_rank: int) -> torch.device:
    """The device of the process with `local_rank`: `cuda:<device_ids[local_rank]>` (or `cuda:<local_rank>`
    without a list) on CUDA, else the CPU. Pure: it allocates nothing and calls no CUDA API."""
    if accelerator != "cuda":
        return torch.device("cpu")
    if device_ids is None:
        return torch.device("cuda", local_rank)
    if not 0 <= local_rank < len(device_ids):
        raise ValueError(
            f"local rank {local_rank} has no GPU in devices={device_ids}; allowed: local ranks 0..{len(device_ids) - 1}"
        )
    return torch.device("cuda", device_ids[local_rank])


def check_clip(value: Any) -> float | None:
    """The clipping threshold; None or 0 (Lightning's "no clipping") mean none."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(
            f"gradient_clip_val={value!r} is invalid; allowed: a number > 0, or 0/None for no clipping"
        )
    return float(value) or None


def check_max_time(value: Any) -> float | None:
    """Lightning's `max_time` in seconds: "DD:HH:MM:SS", a dict of timedelta fields, or a timedelta."""
    if value is None:
        return None
    if isinstance(value, str):
        parts = value.split(":")
        if len(parts) == 4 and all(p.isdigit() for p in parts):
            days, hours, minutes, seconds = map(int, parts)
            value = datetime.timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(value, dict):
        try:
            value = datetime.timedelta(**value)
        except TypeError:
            pass
    if not isinstance(value, datetime.timedelta) or value.total_seconds() <= 0:
        raise ValueError(
            f"max_time={value!r} is invalid; allowed: 'DD:HH:MM:SS', a dict like {{'hours': 2}}, or a timedelta > 0"
        )
    return value.total_seconds()
