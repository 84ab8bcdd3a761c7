"""Whether a module's `training_step` can return None (Lightning: skip this step's update). With several
processes every rank must then agree before a backward that communicates, which costs a collective and
a host sync; a step that never returns None needs no agreement. Read from the step's own code, unless the
module says so itself with a `training_step_may_return_none` attribute (True or False)."""

from __future__ import annotations

import dis
import functools
import inspect
from typing import Any

from torch import nn

DECLARATION = "training_step_may_return_none"


def may_return_none(module: nn.Module) -> bool:
    """The module's `training_step_may_return_none` if it sets one, else whether its `training_step`'s
    code can return None: a `return None`, a bare `return` or the end of the function reached (a step
    that returns None through a variable or a helper is not seen: declare it then)."""
    declared = getattr(module, DECLARATION, None)
    if declared is not None:
        return bool(declared)
    # the class's function: FSDP's registered forward method wraps the instance's in generic code
    return _code_may_return_none(getattr(type(module), "training_step", None))


@functools.cache
def _code_may_return_none(step: Any) -> bool:
    code = getattr(inspect.unwrap(step), "__code__", None) if step is not None else None
    if code is None:  # not Python code we can read: assume it can
        return True
    instructions = list(dis.get_instructions(code))
    for this, following in zip(instructions, instructions[1:] + [None], strict=True):
        if this.opname == "RETURN_CONST" and this.argval is None:  # Python >= 3.12
            return True
        if this.opname == "LOAD_CONST" and this.argval is None and following is not None:
            if following.opname == "RETURN_VALUE":  # Python 3.11
                return True
    return False
