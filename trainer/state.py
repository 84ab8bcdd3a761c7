"""The loop's own state: one dataclass, checkpointed with the run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class LoopState:
    """Counters of a fit: where the run is, so a resumed run continues exactly there."""

    global_step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs started (0-based index of the current one)
    batches_in_epoch: int = 0  # micro-batches consumed in the current epoch
    samples_seen: int = 0  # on this rank
    tokens_seen: int = 0  # on this rank

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):
            setattr(self, f.name, int(state[f.name]))
