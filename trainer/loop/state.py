"""The loop's own state: one dataclass, checkpointed with the run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class LoopState:
    """Counters of a fit: where the run is, so a resumed run continues exactly there.

    `productive_s` and `started_at` give the effective training time: seconds spent in optimizer steps
    that the model kept, over wall-clock seconds since the run first started, less the time it sat stopped
    (from the checkpoint a fit resumes to that fit's start: a resume moves `started_at` on by as much). A
    resume restores the value of the checkpoint, so steps lost to a crash or a rollback (and recomputed)
    count only once; the time they took before the crash is not known to the resumed run and not counted.
    """

    global_step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs started (0-based index of the current one)
    batches_in_epoch: int = 0  # micro-batches consumed in the current epoch
    samples_seen: int = 0  # on this rank
    tokens_seen: int = 0  # on this rank
    productive_s: float = 0.0  # seconds in steps the model kept (not skipped, not rolled back)
    started_at: float = 0.0  # time.time() when the run first started, moved on by the time it sat stopped
    restarts: int = 0  # resumes from a checkpoint, rollbacks included
    skipped_steps: int = 0  # optimizer steps skipped (non-finite or spiking loss, fp16 scaler overflow)
    # batches trained under manual optimization, where Lightning counts logging and validation intervals
    manual_batches: int = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):
            if f.name in state:  # checkpoints from before a counter existed keep its default
                setattr(self, f.name, type(f.default)(state[f.name]))
