"""A module's summary as Lightning's ModelSummary shows it: one row per layer (name, type, parameters, train or
eval mode, FLOPs, and the input and output sizes when the module has an `example_input_array`), then the totals."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

UNITS = (" ", "K", "M", "B", "T")
UNKNOWN, NOT_APPLICABLE, LEFTOVER = "?", "n/a", "other params"
# bits per parameter of a precision's weights; the mixed ones keep fp32 weights (32, the default)
_BITS = {"64": 64, "64-true": 64, "16": 16, "16-true": 16, "bf16": 16, "bf16-true": 16}


@dataclass(frozen=True)
class Summary:
    """The table's columns as (header, cells) and the totals printed below it."""

    columns: list[tuple[str, list[str]]]
    total_parameters: int
    trainable_parameters: int
    model_size: float  # megabytes of the parameters
    total_training_modes: dict[str, int]
    total_flops: int


def check_max_depth(max_depth: Any) -> int:
    """-1 (every module), 0 (no table) or a depth > 0."""
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
        raise ValueError(f"max_depth={max_depth!r} is invalid; allowed: -1 (all), 0 (none) or an int > 0")
    return max_depth


def summarize(
    module: nn.Module,
    max_depth: int,
    precision: str = "32-true",
    to_device: Callable[[Any], Any] = lambda x: x,
) -> Summary:
    """`module`'s layers down to `max_depth` (1: its children); with an `example_input_array`, one forward of it
    (moved by `to_device`, in eval mode, without gradients) measures sizes and FLOPs."""
    layers = _layers(module, max_depth)
    sizes: dict[str, tuple[Any, Any]] = {}
    # the root counts as depth 0 (FlopCounterMode's depth is for its own display)
    counter = FlopCounterMode(display=False, depth=max_depth + 1)
    example = getattr(module, "example_input_array", None)
    if example is not None:
        _measure(module, layers, to_device(example), counter, sizes)
    flops = counter.get_flop_counts()
    prefix = type(module).__name__
    params = [_count(layer.parameters()) for layer in layers.values()]
    total = _count(module.parameters())
    columns = [
        (" ", [str(i) for i in range(len(layers))]),
        ("Name", list(layers)),
        ("Type", [type(layer).__name__ for layer in layers.values()]),
        ("Params", [human_count(n) for n in params]),
        ("Mode", ["train" if layer.training else "eval" for layer in layers.values()]),
        ("FLOPs", [human_count(sum(flops.get(f"{prefix}.{name}", {}).values())) for name in layers]),
    ]
    if example is not None:
        columns.append(("In sizes", [str(sizes.get(name, (UNKNOWN,))[0]) for name in layers]))
        columns.append(("Out sizes", [str(sizes.get(name, (UNKNOWN, UNKNOWN))[1]) for name in layers]))
    # parameters of no listed layer (the root's own) get a row of their own
    if total > sum(params):
        leftover = {" ": " ", "Name": LEFTOVER, "Params": human_count(total - sum(params))}
        for header, cells in columns:
            cells.append(leftover.get(header, NOT_APPLICABLE))
    modes = [m.training for m in list(module.modules())[1:]]
    return Summary(
        columns=columns,
        total_parameters=total,
        trainable_parameters=_count(p for p in module.parameters() if p.requires_grad),
        model_size=total * _BITS.get(precision, 32) / 8 * 1e-6,
        total_training_modes={"train": modes.count(True), "eval": modes.count(False)},
        total_flops=counter.get_total_flops(),
    )


def format_table(summary: Summary) -> str:
    """The summary as Lightning's text table: columns padded to their widest cell, the totals below."""
    columns = summary.columns
    widths = [max([len(header), *(len(cell) for cell in cells)]) for header, cells in columns]
    rule = "-" * (sum(widths) + 3 * (1 + len(columns)))
    lines = [" | ".join(header.ljust(w) for (header, _), w in zip(columns, widths, strict=True)), rule]
    for row in zip(*(cells for _, cells in columns), strict=True):
        lines.append(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    lines.append(rule)
    frozen = summary.total_parameters - summary.trainable_parameters
    totals = [
        (human_count(summary.trainable_parameters), "Trainable params"),
        (human_count(frozen), "Non-trainable params"),
        (human_count(summary.total_parameters), "Total params"),
        (f"{summary.model_size:,.3f}", "Total estimated model params size (MB)"),
        (str(summary.total_training_modes["train"]), "Modules in train mode"),
        (str(summary.total_training_modes["eval"]), "Modules in eval mode"),
        (human_count(summary.total_flops), "Total Flops"),
    ]
    lines += [value.ljust(10) + label for value, label in totals]
    return "\n".join(lines)


def human_count(number: float) -> str:
    """A count with K, M, B, T for thousands to trillions, as Lightning writes it ("123  ", "1.2 K", "400 T")."""
    digits = math.floor(math.log10(number)) + 1 if number > 0 else 1
    groups = min(math.ceil(digits / 3), len(UNITS))
    scaled = number * 10 ** (-3 * (groups - 1))
    if groups == 1 or scaled >= 100:
        return f"{int(scaled):,d} {UNITS[groups - 1]}"
    return f"{scaled:,.1f} {UNITS[groups - 1]}"


def _layers(module: nn.Module, max_depth: int) -> dict[str, nn.Module]:
    """The rows: nothing (0), the children (1), or every module below the root down to `max_depth` (-1: all)."""
    if max_depth == 0:
        return {}
    if max_depth == 1:
        return dict(module.named_children())
    named = list(module.named_modules())[1:]
    return {name: m for name, m in named if max_depth == -1 or name.count(".") < max_depth}


def _count(parameters: Any) -> int:
    """Elements of the parameters whose shape is known (a lazy module's are not yet)."""
    return sum(p.numel() for p in parameters if not isinstance(p, nn.parameter.UninitializedParameter))


def _measure(
    module: nn.Module,
    layers: dict[str, nn.Module],
    example: Any,
    counter: FlopCounterMode,
    sizes: dict[str, tuple[Any, Any]],
) -> None:
    """One forward of `example`: each layer's first input and output sizes into `sizes`, FLOPs into `counter`;
    every submodule's train/eval mode is put back after."""

    def hook(name: str) -> Callable:
        def record(_: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            given = (*args, *kwargs.values())
            # an empty shape (a scalar) shows as unknown, as in Lightning
            inp = _shape(given[0] if len(given) == 1 else given) or UNKNOWN
            sizes.setdefault(name, (inp, _shape(out) or UNKNOWN))

        return record

    handles = [layer.register_forward_hook(hook(name), with_kwargs=True) for name, layer in layers.items()]
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad(), counter:
            if isinstance(example, (list, tuple)):
                module(*example)
            elif isinstance(example, dict):
                module(**example)
            else:
                module(example)
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes:
            m.training = training


def _shape(value: Any) -> Any:
    """A tensor's shape as a list, nested for sequences, "?" for anything else."""
    if hasattr(value, "shape"):
        return list(value.shape)
    if isinstance(value, (list, tuple)):
        return [_shape(v) for v in value]
    return UNKNOWN
