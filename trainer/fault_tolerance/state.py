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
# the parts a step changes before its quorum is joined (its data read and forward): the counters of what it
# saw, the RNG a shuffle or a dropout draws, a stateful loader's position. The others change in the
# optimizer step at the earliest (parameters, optimizer, schedule, loss scale), or at a DiLoCo window's
# start after the quorum (its start weights)
STEP_PARTS = ("loop", "rng", "data")


class SentState:
    """The state this rank sends a recovering peer, as of the start of the step whose quorum asks for it: the
    quorum forms on torchft's thread (which calls this) while the step reads its data and runs its forward.
    `freeze` at the step's start takes what the step changes before the quorum is joined; the rest is read
    when sent. A persistent buffer (batch norm's running statistics) changes in the forward: a copy of each
    is taken too, for a model that has any."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        module = trainer.module
        saved = module.state_dict(keep_vars=True)
        self.buffers = [name for name, _ in module.named_buffers() if name in saved]
        self.frozen: dict[str, Any] = {}
        self.frozen_buffers: dict[str, Any] = {}

    def freeze(self) -> None:
        """Take the step's start values (called before its quorum is requested)."""
        parts = self.trainer.training_state.parts(local=True)
        self.frozen = {name: parts[name].state_dict() for name in STEP_PARTS}
        module = self.trainer.module
        self.frozen_buffers = {name: module.get_buffer(name).detach().clone() for name in self.buffers}

    def __call__(self) -> dict[str, Any]:
        """This rank's share of the training state as of the step's start. It makes no collective (a
        checkpoint gathers RNG states; here each rank sends its own to the same rank of the peer group,
        whose layout is the same)."""
        live = [name for name in REPLICA_PARTS if name not in self.frozen]
        state = {**self.trainer.training_state.capture(live, local=True), **self.frozen}
        if self.frozen_buffers:
            state["model"] = {**state["model"], **self.frozen_buffers}
        return state


def load_replica_state(trainer: Trainer, state: dict[str, Any]) -> None:
    """Continue from a peer's `SentState`: parameters are copied bit for bit; the data position takes
    effect when the loop next begins its iterator (the loop does so right after a recovery)."""
    trainer.training_state.restore(state, REPLICA_PARTS)
