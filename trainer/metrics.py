"""What `TrainModule.log` records, with Lightning's semantics.

Each name is aggregated twice: over the optimizer step (`on_step`: its micro-batches) and over the
epoch (`on_epoch`: the training epoch, or a whole validation/test run), by `reduce_fx` ("mean",
weighted by `batch_size`; "sum", "max", "min"). With both on, Lightning's names: `name_step` and
`name_epoch`. `sync_dist` reduces over the data-parallel ranks with the same function (a weighted mean
as sums of values and weights). `logger=False` keeps a value out of the loggers but not out of
`trainer.callback_metrics`; `prog_bar` shows it in the progress bar.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

REDUCE_FX = ("mean", "sum", "max", "min")
_TORCH_FX = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


def check_reduce_fx(name: str, reduce_fx: object) -> str:
    """`reduce_fx` as one of REDUCE_FX (Lightning also takes torch.mean etc.); a one-line error otherwise."""
    fx = _TORCH_FX.get(reduce_fx, reduce_fx) if callable(reduce_fx) else reduce_fx
    if fx not in REDUCE_FX:
        raise ValueError(f"log({name!r}) reduce_fx={reduce_fx!r} is unknown; allowed: {', '.join(REDUCE_FX)}")
    return fx


@dataclass
class _Options:
    reduce_fx: str
    sync_dist: bool
    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool


class _Accumulator:
    """Running aggregate of one name: a weighted sum and its weight for "mean", else the value itself."""

    def __init__(self, fx: str) -> None:
        self.fx = fx
        self.value: torch.Tensor | None = None
        self.weight = 0.0

    def add(self, value: torch.Tensor, weight: float) -> None:
        if self.value is None:
            self.value = value * weight if self.fx == "mean" else value
        elif self.fx == "mean":
            self.value = self.value + value * weight
        elif self.fx == "sum":
            self.value = self.value + value
        else:
            self.value = (torch.maximum if self.fx == "max" else torch.minimum)(self.value, value)
        self.weight += weight


class MetricBuffer:
    """Logged values of the step in progress and of the epoch in progress; tensors stay on device."""

    def __init__(self) -> None:
        self.options: dict[str, _Options] = {}
        self._step: dict[str, _Accumulator] = {}
        self._epoch: dict[str, _Accumulator] = {}

    @property
    def prog_bar_names(self) -> set[str]:
        return {key for n, o in self.options.items() if o.prog_bar for key in _keys(n, o)}

    def add(
        self,
        name: str,
        value: float | torch.Tensor,
        *,
        on_step: bool,
        on_epoch: bool,
        reduce_fx: object = "mean",
        batch_size: int | None = None,
        sync_dist: bool = False,
        prog_bar: bool = False,
        logger: bool = True,
    ) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"log({name!r}) got a tensor of shape {tuple(value.shape)}; allowed: a scalar"
                )
            value = value.detach().float().reshape(())
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"log({name!r}) got a {type(value).__name__}; allowed: a number or scalar tensor")
        else:
            value = torch.tensor(float(value))
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(f"log({name!r}) batch_size={batch_size!r} is invalid; allowed: an int >= 1")
        if not (on_step or on_epoch):
            raise ValueError(
                f"log({name!r}) has on_step=False and on_epoch=False; allowed: at least one True"
            )
        options = _Options(check_reduce_fx(name, reduce_fx), sync_dist, prog_bar, logger, on_step, on_epoch)
        self.options[name] = options
        for on, store in ((on_step, self._step), (on_epoch, self._epoch)):
            if on:
                store.setdefault(name, _Accumulator(options.reduce_fx)).add(value, batch_size or 1)

    def compute_step(self, reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> dict[str, float]:
        """The step's values under their logged names (`name`, or `name_step` when also on_epoch)."""
        return self._compute(self._step, reduce, "_step")

    def compute_epoch(self, reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> dict[str, float]:
        """The epoch's values under their logged names (`name`, or `name_epoch` when also on_step)."""
        return self._compute(self._epoch, reduce, "_epoch")

    def not_for_loggers(self) -> set[str]:
        """Logged names (with their suffixes) that were logged with logger=False."""
        return {key for n, o in self.options.items() if not o.logger for key in _keys(n, o)}

    def reset_step(self) -> None:
        self._step.clear()

    def reset(self) -> None:
        self._step.clear()
        self._epoch.clear()

    def _compute(
        self, store: dict[str, _Accumulator], reduce: Callable[[torch.Tensor, str], torch.Tensor], suffix: str
    ) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, acc in store.items():
            opts = self.options[name]
            value, weight = acc.value, torch.tensor(acc.weight, device=acc.value.device)
            if opts.sync_dist:  # a weighted mean over ranks: sum the weighted sums and the weights
                if opts.reduce_fx == "mean":
                    value, weight = reduce(torch.stack([value, weight]), "sum").unbind(0)
                else:
                    value = reduce(value, opts.reduce_fx)
            if opts.reduce_fx == "mean":
                value = value / weight
            out[name + suffix if opts.on_step and opts.on_epoch else name] = float(value)
        return out


def _keys(name: str, options: _Options) -> list[str]:
    if options.on_step and options.on_epoch:
        return [name + "_step", name + "_epoch"]
    return [name]
