"""Checks of Trainer flags: one-line errors naming the flag, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.core.schedules import SCHEDULES, LRSchedule


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


def check_val_interval(value: Any) -> int | float | datetime.timedelta | None:
    """None (end of every epoch), an int of optimizer steps, a float fraction of an epoch, or Lightning 2.6's
    time-based form ("DD:HH:MM:SS", a dict of timedelta fields, a timedelta): a timedelta."""
    if value is None:
        return None
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    duration = _duration(value)
    if duration is None:
        raise ValueError(
            f"val_check_interval={value!r} is invalid; allowed: None, an int >= 1 (steps), a float in (0, 1] (of an "
            "epoch), or a time: 'DD:HH:MM:SS', a dict like {'minutes': 30}, or a timedelta > 0"
        )
    return duration


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
    """Processes per node: an int (or its digits as a string), a list of GPU indices (one process each, see
    `check_device_ids`), -1 = every GPU, or "auto" = what torchrun/SLURM started, else every GPU, else 1
    on the CPU. Lightning's CPU accelerator refuses -1 (a CPU has no device count to take), and so does this."""
    if value == "auto":
        from trainer.core.launch import detect_world

        world = detect_world()
        if world is not None:
            return world.local_world_size
        return torch.cuda.device_count() if accelerator == "cuda" else 1
    if isinstance(value, (list, tuple)):
        return len(check_device_ids(value, accelerator))
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, str):
        raise ValueError(
            f"devices={value!r} is invalid; allowed: an int >= 1, -1 (every GPU), a list of GPU indices or 'auto'"
        )
    if value == -1 and not isinstance(value, bool):
        if accelerator != "cuda":
            raise ValueError(
                f"devices=-1 (every GPU) with accelerator={accelerator!r} is invalid, as under Lightning; "
                "allowed on the CPU: an int >= 1 (gloo processes) or 'auto' (1)"
            )
        return torch.cuda.device_count()
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
    duration = _duration(value)
    if duration is None:
        raise ValueError(
            f"max_time={value!r} is invalid; allowed: 'DD:HH:MM:SS', a dict like {{'hours': 2}}, or a timedelta > 0"
        )
    return duration.total_seconds()


def _duration(value: Any) -> datetime.timedelta | None:
    """Lightning's durations: "DD:HH:MM:SS", a dict of timedelta fields or a timedelta, if > 0; else None."""
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
        return None
    return value


@dataclass(frozen=True)
class LoopFlags:
    """The Trainer's loop flags, checked, with their derived settings: `fast_dev_run`'s limits applied and
    the stop default (neither max_steps nor max_epochs: one epoch). The Trainer keeps each as an attribute
    of the same name (`trainer.max_steps`, ...), as Lightning's does."""

    max_steps: int | None
    max_epochs: int | None
    # the fit does not stop for `should_stop` (EarlyStopping) before both are met; the max_* still bound it
    min_steps: int | None
    min_epochs: int | None
    val_check_interval: int | float | datetime.timedelta | None  # a timedelta: validate by wall-clock time
    val_at_start: bool
    num_sanity_val_steps: int
    enable_model_summary: bool
    check_val_every_n_epoch: int | None  # None: by `val_check_interval` steps only, as in Lightning
    max_time: float | None  # seconds
    limit_train_batches: int | float | None
    limit_val_batches: int | float | None
    limit_test_batches: int | float | None
    limit_predict_batches: int | float | None
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    lr_schedule: str
    warmup_steps: int
    min_lr_ratio: float
    deterministic: bool | str  # "warn": deterministic where torch can, a warning where it cannot
    log_every_n_steps: int
    default_root_dir: Path
    enable_progress_bar: bool
    enable_checkpointing: bool  # whether a ModelCheckpoint is added when the callbacks have none
    # a checkpoint without a manifest (or an empty one) loads only when asked, with a warning
    allow_unverified_checkpoints: bool
    # Lightning's: train (and validate) on the first n batches (or that fraction), unshuffled; 0: off
    overfit_batches: int | float
    benchmark: bool | None  # torch.backends.cudnn.benchmark during each stage (None: left as it is)
    inference_mode: bool  # validate/test/predict under torch.inference_mode (else no_grad)
    use_distributed_sampler: bool  # False: every rank reads its loaders as given, unsharded
    detect_anomaly: bool  # torch.autograd's anomaly detection during each stage
    barebones: bool  # Lightning's speed-only mode: no checkpoints, loggers, bar, summary, sanity check
    sync_batchnorm: bool  # BatchNorm layers as SyncBatchNorm under several data-parallel ranks
    reload_dataloaders_every_n_epochs: int  # 0: the loaders of a fit are read once
    enable_autolog_hparams: bool  # the hyperparameters go to the loggers at the start of a fit
    model_registry: str | None  # Lightning's model-hub name: kept, nothing uploads here


LOOP_FLAGS = (
    *(f.name for f in dataclasses.fields(LoopFlags)),
    "fast_dev_run",
)  # the Trainer's arguments read


def check_loop_flags(fast_dev_run: bool | int = False, **given: Any) -> LoopFlags:
    """Every loop flag of the Trainer checked (a one-line error names the first bad one), `given` by the
    names of `LoopFlags`' fields; Lightning's "not set" values (None, max_steps=-1) mean this Trainer's
    defaults, and max_epochs=-1 no epoch limit."""
    given.update({name: default for name, default in _DEFAULTS.items() if given[name] is None})
    if fast_dev_run:  # Lightning's smoke run: n batches of each loop (True: 1), no checkpoints
        n = check_int("fast_dev_run", 1 if fast_dev_run is True else fast_dev_run, 1)
        given.update(max_steps=n, max_epochs=1, val_check_interval=None, enable_checkpointing=False)
        given.update(num_sanity_val_steps=0, log_every_n_steps=1, check_val_every_n_epoch=1)
        given.update(dict.fromkeys(_LIMITS, n))
    overfit = check_overfit_batches(given["overfit_batches"])
    if overfit:  # as Lightning: the train and val limits, whatever fast_dev_run set
        given.update(dict.fromkeys(_LIMITS[:2], overfit))
    max_steps = (
        None if given["max_steps"] == -1 else check_int("max_steps", given["max_steps"], 1, allow_none=True)
    )
    unbounded = given["max_epochs"] == -1
    max_epochs = None if unbounded else check_int("max_epochs", given["max_epochs"], 1, allow_none=True)
    if max_steps is None and max_epochs is None and not unbounded:
        max_epochs = 1
    val_check_interval = check_val_interval(given["val_check_interval"])
    num_sanity_val_steps = check_int("num_sanity_val_steps", given["num_sanity_val_steps"], -1)
    check_val_every_n_epoch = check_val_epochs(given["check_val_every_n_epoch"], val_check_interval)
    max_time = check_max_time(given["max_time"])
    limits = {name: check_limit(name, given[name]) for name in _LIMITS}
    accumulate = check_int("accumulate_grad_batches", given["accumulate_grad_batches"], 1)
    clip_val = check_clip(given["gradient_clip_val"])
    clip_algorithm = check_choice(
        "gradient_clip_algorithm", given["gradient_clip_algorithm"], ("norm", "value")
    )
    lr_schedule = check_choice("lr_schedule", given["lr_schedule"], SCHEDULES)
    warmup_steps = check_int("warmup_steps", given["warmup_steps"], 0)
    min_lr_ratio = given["min_lr_ratio"]
    if (
        isinstance(min_lr_ratio, bool)
        or not isinstance(min_lr_ratio, (int, float))
        or not 0 <= min_lr_ratio <= 1
    ):
        raise ValueError(f"min_lr_ratio={min_lr_ratio!r} is invalid; allowed: a number in [0, 1]")
    if max_steps is not None:  # the schedule's own checks, now, before any process starts
        LRSchedule(lr_schedule, warmup_steps, max_steps, float(min_lr_ratio))
    deterministic = check_deterministic(given["deterministic"])
    return LoopFlags(
        max_steps=max_steps,
        max_epochs=max_epochs,
        min_steps=check_int("min_steps", given["min_steps"], 0, allow_none=True),
        min_epochs=check_int("min_epochs", given["min_epochs"], 0, allow_none=True),
        val_check_interval=val_check_interval,
        val_at_start=bool(given["val_at_start"]),
        num_sanity_val_steps=num_sanity_val_steps,
        enable_model_summary=bool(given["enable_model_summary"]),
        check_val_every_n_epoch=check_val_every_n_epoch,
        max_time=max_time,
        **limits,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip_val,
        gradient_clip_algorithm=clip_algorithm,
        lr_schedule=lr_schedule,
        warmup_steps=warmup_steps,
        min_lr_ratio=float(min_lr_ratio),
        deterministic=deterministic,
        log_every_n_steps=check_int("log_every_n_steps", given["log_every_n_steps"], 1),
        default_root_dir=Path(given["default_root_dir"]),
        enable_progress_bar=bool(given["enable_progress_bar"]),
        enable_checkpointing=bool(given["enable_checkpointing"]),
        allow_unverified_checkpoints=bool(given["allow_unverified_checkpoints"]),
        overfit_batches=overfit,
        benchmark=check_benchmark(given["benchmark"], deterministic),
        inference_mode=bool(given["inference_mode"]),
        use_distributed_sampler=bool(given["use_distributed_sampler"]),
        detect_anomaly=bool(given["detect_anomaly"]),
        barebones=bool(given["barebones"]),
        sync_batchnorm=bool(given["sync_batchnorm"]),
        reload_dataloaders_every_n_epochs=check_int(
            "reload_dataloaders_every_n_epochs", given["reload_dataloaders_every_n_epochs"], 0
        ),
        enable_autolog_hparams=bool(given["enable_autolog_hparams"]),
        model_registry=check_model_registry(given["model_registry"]),
    )


def check_overfit_batches(value: Any) -> int | float:
    """Lightning's `overfit_batches`: 0 (off), an int count of batches or a float fraction in (0, 1]."""
    if value == 0 and not isinstance(value, bool):
        return 0.0
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(
        f"overfit_batches={value!r} is invalid; allowed: 0 (off), an int >= 1 or a float in (0.0, 1.0]"
    )


def check_val_epochs(value: Any, val_check_interval: int | float | datetime.timedelta | None) -> int | None:
    """`check_val_every_n_epoch`: an int >= 1, or None (Lightning's: validate by steps or time only, which
    needs an int or time `val_check_interval`)."""
    if value is None:
        if not isinstance(val_check_interval, (int, datetime.timedelta)):
            raise ValueError(
                f"check_val_every_n_epoch=None validates every val_check_interval steps or time, but "
                f"val_check_interval={val_check_interval!r}; allowed: an int or a time val_check_interval, or "
                "check_val_every_n_epoch >= 1"
            )
        return None
    return check_int("check_val_every_n_epoch", value, 1)


def check_deterministic(value: Any) -> bool | str:
    """True, False (None: False) or Lightning's "warn" (deterministic algorithms where torch has them)."""
    if value is None or value is False:
        return False
    if value is True or value == "warn":
        return value
    raise ValueError(f"deterministic={value!r} is invalid; allowed: True, False, 'warn' or None")


def check_benchmark(value: Any, deterministic: bool | str) -> bool | None:
    """`torch.backends.cudnn.benchmark` for the stages; None leaves it as it is, unless `deterministic` asks
    for it off (Lightning's rule: autotuned kernels may differ from run to run)."""
    if value is None:
        return False if deterministic else None
    if not isinstance(value, bool):
        raise ValueError(f"benchmark={value!r} is invalid; allowed: True, False or None")
    return value


def check_model_registry(value: Any) -> str | None:
    """Lightning's model-hub name, its ':version' dropped as Lightning drops it."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"model_registry={value!r} is invalid; allowed: a model name or None")
    return value.split(":")[0]


# this Trainer's defaults for the flags whose Lightning default is None ("not set")
_DEFAULTS = {
    "enable_checkpointing": True,
    "enable_progress_bar": True,
    "enable_model_summary": True,
    "num_sanity_val_steps": 2,
    "log_every_n_steps": 10,
    "gradient_clip_algorithm": "norm",
    "default_root_dir": "runs",
}
_LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches")
