"""What `TrainModule.log` records, with Lightning's semantics.

Each name is aggregated twice: over the optimizer step (`on_step`: its micro-batches) and over the
epoch (`on_epoch`: the training epoch, or a whole validation/test run), by `reduce_fx` ("mean",
weighted by `batch_size`, which an epoch mean infers from the loop's batch when not given, as Lightning;
"sum", "max", "min"). With both on, Lightning's names: `name_step` and
`name_epoch`. `sync_dist` reduces over the data-parallel ranks with the same function (a weighted mean
as sums of values and weights). `logger=False` keeps a value out of the loggers but not out of
`trainer.callback_metrics`; `prog_bar` shows it in the progress bar.

A torchmetrics `Metric` is logged as Lightning logs one: the user's step updates it (`self.acc(preds, y)`
or `self.acc.update(...)`); per step its value is the last `forward`'s (the batch's), per epoch
`metric.compute()` (torchmetrics' own sync over the default process group), then `metric.reset()`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainer.core.batch_size import infer_batch_size
from trainer.core.logging import rank_zero_info

REDUCE_FX = ("mean", "sum", "max", "min")
_TORCH_FX = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


def is_torchmetric(value: object) -> bool:
    """Whether `value` is a torchmetrics `Metric` (torchmetrics is imported only by code that made one)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.Metric)


def metric_items(dictionary: Any) -> Any:
    """The (name, value) pairs of a `log_dict` argument: a mapping, or a torchmetrics `MetricCollection`
    under its prefixed names (without copying states shared by compute groups, as Lightning reads it)."""
    torchmetrics = sys.modules.get("torchmetrics")
    if torchmetrics is not None and isinstance(dictionary, torchmetrics.MetricCollection):
        return dictionary.items(keep_base=False, copy_state=not dictionary._enable_compute_groups)
    return dictionary.items()


@contextlib.contextmanager
def kept_metric_states(module: Any) -> Iterator[None]:
    """Every torchmetrics `Metric` inside `module` ends the block with the state it began with: a step run
    for its loss alone (`Trainer.loss_on`) must not count its batch into an epoch's metric."""
    metrics = [m for m in module.modules() if is_torchmetric(m)]
    saved = [
        (m, {k: _copied(getattr(m, k)) for k in m._defaults}, m._update_count, m._computed, m._forward_cache)
        for m in metrics
    ]
    try:
        yield
    finally:
        for metric, states, count, computed, cache in saved:
            for key, value in states.items():
                setattr(metric, key, value)
            metric._update_count, metric._computed, metric._forward_cache = count, computed, cache


def _copied(state: Any) -> Any:
    return state.clone() if isinstance(state, torch.Tensor) else list(state)


def check_reduce_fx(name: str, reduce_fx: object) -> str:
    """`reduce_fx` as one of REDUCE_FX (Lightning also takes torch.mean etc.); a one-line error otherwise."""
    fx = _TORCH_FX.get(reduce_fx, reduce_fx) if callable(reduce_fx) else reduce_fx
    if fx not in REDUCE_FX:
        raise ValueError(f"log({name!r}) reduce_fx={reduce_fx!r} is unknown; allowed: {', '.join(REDUCE_FX)}")
    return fx


_AMBIGUOUS_SAID: set[str] = set()


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
        self._metrics: dict[str, Any] = {}  # torchmetrics Metrics logged since the last reset, by name
        self._metric_steps: dict[str, torch.Tensor] = {}  # their batch values (forward's) of this step
        self.batch: Any = None  # the batch the loop is on: an epoch mean's weight when log has no batch_size
        self._batch_size: int | None = None  # inferred from `batch` at the first log that needs it

    def set_batch(self, batch: Any) -> None:
        """The batch the loop starts (None: between batches, where a value weighs 1), as Lightning's."""
        self.batch, self._batch_size = batch, None

    def _weight(self, name: str, batch_size: int | None, on_epoch: bool, fx: str) -> int:
        """Lightning's weight of a logged value: `batch_size`, else for an epoch mean the size inferred
        from the current batch (once per batch), else 1."""
        if batch_size is not None:
            return batch_size
        if self.batch is None or not on_epoch or fx != "mean":
            return 1
        if self._batch_size is None:
            self._batch_size, ambiguous = infer_batch_size(self.batch, name)
            if ambiguous and name not in _AMBIGUOUS_SAID:  # once per name and process, as Lightning's
                _AMBIGUOUS_SAID.add(name)
                rank_zero_info(
                    f"warning: log({name!r}): the batch holds tensors of several first dimensions; its epoch "
                    f"mean weighs each batch by the first tensor's, {self._batch_size}; pass batch_size= to choose"
                )
        return self._batch_size

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
        if not (on_step or on_epoch):
            raise ValueError(
                f"log({name!r}) has on_step=False and on_epoch=False; allowed: at least one True"
            )
        if is_torchmetric(
            value
        ):  # it aggregates (and syncs) itself: reduce_fx, batch_size and sync_dist unused
            self.options[name] = _Options("mean", False, prog_bar, logger, on_step, on_epoch)
            self._metrics[name] = value
            cache = value._forward_cache  # None when only update() ran: no step value, as in Lightning
            if on_step and isinstance(cache, torch.Tensor) and cache.numel() == 1:
                self._metric_steps[name] = cache.detach()
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"log({name!r}) got a tensor of shape {tuple(value.shape)}; allowed: a scalar"
                )
            value = value.detach().float().reshape(())
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"log({name!r}) got a {type(value).__name__}; allowed: a number, a scalar tensor or a "
                "torchmetrics Metric"
            )
        else:
            value = torch.tensor(float(value))
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(f"log({name!r}) batch_size={batch_size!r} is invalid; allowed: an int >= 1")
        options = _Options(check_reduce_fx(name, reduce_fx), sync_dist, prog_bar, logger, on_step, on_epoch)
        self.options[name] = options
        weight = self._weight(name, batch_size, on_epoch, options.reduce_fx)
        for on, store in ((on_step, self._step), (on_epoch, self._epoch)):
            if on:
                store.setdefault(name, _Accumulator(options.reduce_fx)).add(value, weight)

    def has_step_values(self) -> bool:
        """Whether anything was logged per step since the last `reset_step`."""
        return bool(self._step or self._metric_steps)

    def step_values(self, reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's values under their logged names (`name`, or `name_step` when also on_epoch), as 0-dim
        tensors where they were computed: reading them is left to the caller (a host sync on a GPU)."""
        values = {name: self._reduced(name, acc, reduce) for name, acc in self._step.items()}
        values.update(self._metric_steps)
        return self._named(values, "_step")

    def compute_step(self, reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> dict[str, float]:
        """The step's values under their logged names (`name`, or `name_step` when also on_epoch)."""
        return {name: float(value) for name, value in self.step_values(reduce).items()}

    def compute_epoch(self, reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> dict[str, float]:
        """The epoch's values under their logged names (`name`, or `name_epoch` when also on_step)."""
        out = {name: float(self._reduced(name, acc, reduce)) for name, acc in self._epoch.items()}
        out = self._named(out, "_epoch")
        # compute() is a collective under torchmetrics' sync: every rank calls it, in the same order
        computed = {n: m.compute() for n, m in self._metrics.items() if self.options[n].on_epoch}
        for name, value in computed.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                got = (
                    f"a tensor of shape {tuple(value.shape)}"
                    if isinstance(value, torch.Tensor)
                    else type(value).__name__
                )
                raise ValueError(
                    f"log({name!r}): {type(self._metrics[name]).__name__}.compute() returned {got}; allowed: a "
                    "metric whose compute() is a scalar tensor"
                )
        out.update(self._named({n: float(v) for n, v in computed.items()}, "_epoch"))
        return out

    def not_for_loggers(self) -> set[str]:
        """Logged names (with their suffixes) that were logged with logger=False."""
        return {key for n, o in self.options.items() if not o.logger for key in _keys(n, o)}

    def reset_step(self) -> None:
        self._step.clear()
        self._metric_steps.clear()

    def reset(self) -> None:
        """End of an epoch or loop: aggregates cleared, logged torchmetrics Metrics reset."""
        self.reset_step()
        self._epoch.clear()
        for metric in self._metrics.values():
            metric.reset()
        self._metrics.clear()

    def _named(self, values: dict[str, Any], suffix: str) -> dict[str, Any]:
        """`values` under their logged names: `name`, or `name` + `suffix` when logged both per step and epoch."""
        return {
            n + suffix if self.options[n].on_step and self.options[n].on_epoch else n: v
            for n, v in values.items()
        }

    def _reduced(
        self, name: str, acc: _Accumulator, reduce: Callable[[torch.Tensor, str], torch.Tensor]
    ) -> torch.Tensor:
        """`name`'s aggregate, over the ranks with sync_dist; on its device (the weight is filled there, not
        copied from the host: no sync)."""
        opts = self.options[name]
        value, weight = acc.value, torch.full_like(acc.value, acc.weight)
        if opts.sync_dist:  # a weighted mean over ranks: sum the weighted sums and the weights
            if opts.reduce_fx == "mean":
                value, weight = reduce(torch.stack([value, weight]), "sum").unbind(0)
            else:
                value = reduce(value, opts.reduce_fx)
        if opts.reduce_fx == "mean":
            value = value / weight
        return value


class UnreadStepValues:
    """The values of the training steps that wrote no logger row (`log_every_n_steps`), kept as tensors where
    they were computed: `trainer.callback_metrics` and `logged_metrics` take them in when read, so a fit
    pays a host sync per read of those, not per step."""

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}  # every name, the latest step's value
        self._logged: set[str] = set()  # the names that go into logged_metrics (not logger=False)

    def add(self, values: dict[str, torch.Tensor], hidden: set[str]) -> None:
        self._values.update(values)
        self._logged |= set(values) - hidden

    def settle(self, callback_metrics: dict[str, float], logged_metrics: dict[str, float]) -> None:
        """Read the values into `callback_metrics` (with bare names, `with_bare_names`) and `logged_metrics`."""
        if not self._values:
            return
        values = {name: float(value) for name, value in self._values.items()}
        callback_metrics.update(with_bare_names(values))
        logged_metrics.update({name: v for name, v in values.items() if name in self._logged})
        self._values, self._logged = {}, set()


def with_bare_names(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` plus, for each `name_step`/`name_epoch`, `name` with that value (the later one wins), as
    Lightning's `callback_metrics` hold them."""
    out = dict(metrics)
    for key, value in metrics.items():
        if key.endswith(("_step", "_epoch")):
            out[key[: key.rindex("_")]] = value
    return out


def _keys(name: str, options: _Options) -> list[str]:
    if options.on_step and options.on_epoch:
        return [name + "_step", name + "_epoch"]
    return [name]
