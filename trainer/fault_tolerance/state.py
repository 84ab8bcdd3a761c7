"""The training state a rejoining replica group receives from a healthy peer: what a checkpoint carries
(model, optimizer, LR schedule, gradient scaler, loop counters, RNG, data position, strategy and module
state, DiLoCo's window), taken from memory on each rank and sent rank to rank (rank r of the peer group to rank r)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.trainer import Trainer

# The parts of the Trainer's `training_state` a peer sends, in the order they load (the optimizer before the
# schedule, which recomputes its groups' LR). Callbacks keep their own: it describes this group's run folder
# (its checkpoints, its timers), not the model.
REPLICA_PARTS = (
    "model", "optimizer", "scheduler", "precision", "loop", "rng", "data", "strategy", "module", "outer_sync",
)  # fmt: skip


def replica_state(trainer: Trainer) -> dict[str, Any]:
    """This rank's share of the live training state. It runs in torchft's quorum thread while the loop
    waits between steps, so it makes no collective (a checkpoint gathers RNG states; here each rank sends its
    own to the same rank of the peer group, whose layout is the same)."""
    return trainer.training_state.capture(REPLICA_PARTS, local=True)


def load_replica_state(trainer: Trainer, state: dict[str, Any]) -> None:
    """Continue from a peer's `replica_state`: parameters are copied bit for bit; the data position takes
    effect when the loop next begins its iterator (the loop does so right after a recovery)."""
    trainer.training_state.restore(state, REPLICA_PARTS)
