"""Per-block `torch.compile`: each unit's `forward` is compiled in place, so the module, its hooks (FSDP's
gathers, DDP's) and its state-dict keys stay as they are and run eagerly around the compiled code.
Identical blocks share one compiled graph (their `forward` is one code object). `fullgraph=True` is tried
first; a block that breaks the graph is compiled again without it, and the break is reported once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.core.logging import rank_zero_info

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile(value: Any) -> str | None:
    """The torch.compile mode the Trainer flag `compile` asks for: None (eager) for False, "default" for
    True, or one of torch's mode names."""
    if value is None or value is False:
        return None
    if value is True:
        return "default"
    if isinstance(value, str) and value in MODES:
        return value
    raise ValueError(
        f"compile={value!r} is invalid; allowed: False, True or a torch.compile mode: {', '.join(MODES)}"
    )


def compile_units(units: list[nn.Module], mode: str) -> None:
    """Compile each unit's forward in place (an instance attribute shadowing the class's `forward`)."""
    for unit in units:
        unit.forward = CompiledForward(unit.forward, mode, type(unit).__name__)


class CompiledForward:
    """A unit's forward compiled with fullgraph=True; where that fails on a graph break, compiled again
    without it (dynamo then splits the graph at the break) and the break is logged once."""

    def __init__(self, forward: Callable[..., Any], mode: str, name: str) -> None:
        self.eager, self.mode, self.name = forward, mode, name
        self.fullgraph, self.calls = True, 0
        self.compiled = torch.compile(forward, fullgraph=True, mode=mode)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if not self.fullgraph:
            return self.compiled(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as err:  # raised while tracing, before anything ran
            self.fullgraph = False
            self.compiled = torch.compile(self.eager, fullgraph=False, mode=self.mode)
            reason = str(err).strip().splitlines()[0]
            _warn_once(f"torch.compile: {self.name}.forward breaks the graph ({reason}); compiled in pieces")
            return self.compiled(*args, **kwargs)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        rank_zero_info(f"warning: {message}")


def compiled_units(module: nn.Module) -> list[CompiledForward]:
    """The compiled forwards inside `module` (its own and its submodules')."""
    return [m.forward for m in module.modules() if isinstance(vars(m).get("forward"), CompiledForward)]
