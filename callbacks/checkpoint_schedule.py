"""When ModelCheckpoint saves: its interval arguments (ours and Lightning's names for them) checked,
every_n_steps="auto" chosen by Young/Daly, and Lightning's rule for when an epoch's save comes."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

import torch

from strategies.plan.checkpoint_interval import effective_fraction, young_daly_interval
from trainer import flags
from trainer.core.logging import rank_zero_info

if TYPE_CHECKING:
    from trainer.trainer import Trainer


def intervals(
    every_n_steps: int | str | None,
    every_n_train_steps: int | None,
    every_n_minutes: float | None,
    train_time_interval: datetime.timedelta | None,
    mtbf_hours: float | None,
) -> tuple[int | None, float | None, bool]:
    """(every_n_steps, every_n_minutes, whether every_n_steps is "auto": None until the first save of
    each fit decides it), each given once under either name; a one-line ValueError otherwise."""
    every_n_steps = _one_of(
        "every_n_steps", every_n_steps, "every_n_train_steps", every_n_train_steps or None
    )
    every_n_minutes = _one_of(
        "every_n_minutes", every_n_minutes, "train_time_interval", _minutes(train_time_interval)
    )
    auto = _check_auto(every_n_steps, mtbf_hours)
    if auto:
        every_n_steps = None
    flags.check_int("every_n_steps", every_n_steps, 1, allow_none=True)
    flags.check_number("every_n_minutes", every_n_minutes, 0, strict=True, allow_none=True)
    return every_n_steps, every_n_minutes, auto


def epochs(
    every_n_epochs: int | None, monitor: str | None, every_n_steps: int | None, every_n_minutes: float | None
) -> int:
    """`every_n_epochs`, never with a step or time interval (a one-line ValueError); None: Lightning's
    default, every epoch for a monitored metric without a step or time interval, else never (0)."""
    flags.check_int("every_n_epochs", every_n_epochs, 0, allow_none=True)
    if every_n_epochs and (every_n_steps or every_n_minutes):
        raise ValueError(
            f"every_n_epochs={every_n_epochs} with a step or time interval; allowed: one of "
            "every_n_epochs, every_n_train_steps/every_n_steps, train_time_interval/every_n_minutes"
        )
    if every_n_epochs is None:
        return int(monitor is not None and not every_n_steps and not every_n_minutes)
    return every_n_epochs


def young_daly(
    trainer: Trainer, save_cost_s: float, step_time_s: float, mtbf_hours: float
) -> tuple[float, float, float, int, float]:
    """every_n_steps="auto"'s choice from this rank's measured save cost and step time: (the slowest
    rank's save cost and step time, Young/Daly's interval sqrt(2 C MTBF) in seconds of training, that
    interval in steps, the projected effective training time); logged, and said in one line."""
    # every rank must save at the same steps: the slowest rank's numbers decide for all
    strategy = trainer.strategy
    measured = torch.tensor([save_cost_s, step_time_s], dtype=torch.float64, device=strategy.root_device)
    cost_s, step_s = strategy.reduce(measured, "max", group="world").tolist()
    mtbf_s = 3600.0 * mtbf_hours
    interval_s = young_daly_interval(cost_s, mtbf_s)
    steps = max(1, round(interval_s / max(step_s, 1e-9)))
    fraction = effective_fraction(cost_s, steps * step_s, mtbf_s)
    trainer.log_metrics({"checkpoint/every_n_steps": float(steps), "checkpoint/effective_fraction": fraction})
    rank_zero_info(
        f"ModelCheckpoint: every_n_steps='auto': a save costs {cost_s:.3g} s and a step {step_s:.3g} s; with "
        f"mtbf_hours={mtbf_hours:g}, Young/Daly's sqrt(2 C MTBF) = {interval_s:.4g} s: every {steps} steps; "
        f"projected effective training time {100 * fraction:.2f}% (1 - C/T - T/(2 MTBF))"
    )
    return cost_s, step_s, interval_s, steps, fraction


def saves_at_epoch_end(trainer: Trainer, save_on_train_epoch_end: bool | None) -> bool:
    """Whether epoch saves happen at the training epoch's end, else after each validation: Lightning's
    rule (at the epoch's end when validation runs once per epoch at its end, or never)."""
    if save_on_train_epoch_end is not None:
        return save_on_train_epoch_end
    if trainer.check_val_every_n_epoch != 1:
        return False
    if trainer.val_dataloaders is None or trainer.limit_val_batches == 0:
        return True
    return trainer.val_check_interval in (None, 1.0)


def _one_of(ours: str, value: Any, lightnings: str, alias: Any) -> Any:
    """Our argument or Lightning's name for it; both given and different is a one-line ValueError."""
    if value is not None and alias is not None and value != alias:
        raise ValueError(f"{ours}={value!r} and {lightnings} say different things; allowed: one of them")
    return value if value is not None else alias


def _check_auto(every_n_steps: Any, mtbf_hours: Any) -> bool:
    """Whether the interval is "auto"; a one-line ValueError for a string other than "auto", or for an
    MTBF that is missing, not > 0, or given without "auto"."""
    if isinstance(every_n_steps, str) and every_n_steps != "auto":
        raise ValueError(
            f"every_n_steps={every_n_steps!r} is invalid; allowed: an int >= 1, 'auto' (with mtbf_hours) or None"
        )
    auto = every_n_steps == "auto"
    if auto and mtbf_hours is None:
        raise ValueError(
            "every_n_steps='auto' needs mtbf_hours, the job's mean time between failures; allowed: a number "
            "of hours > 0"
        )
    if mtbf_hours is not None and not auto:
        raise ValueError(
            f"mtbf_hours={mtbf_hours!r} without every_n_steps='auto'; allowed: set every_n_steps='auto' too"
        )
    flags.check_number("mtbf_hours", mtbf_hours, 0, strict=True, allow_none=True)
    return auto


def _minutes(interval: datetime.timedelta | None) -> float | None:
    if interval is None:
        return None
    if not isinstance(interval, datetime.timedelta):
        raise ValueError(
            f"train_time_interval={interval!r} is invalid; allowed: a datetime.timedelta or None"
        )
    return interval.total_seconds() / 60
