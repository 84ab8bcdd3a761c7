"""The training state a rejoining replica group receives from a healthy peer: what a checkpoint carries
(model, optimizer, LR schedule, gradient scaler, loop counters, RNG, data position, strategy and module
state), taken from memory on each rank and sent rank to rank (rank r of the peer group to rank r)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.core.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from trainer.trainer import Trainer


def replica_state(trainer: Trainer) -> dict[str, Any]:
    """This rank's share of the live training state. It runs in torchft's quorum thread while the loop
    waits between steps, so it makes no collective (a checkpoint gathers RNG states; here each rank sends its
    own to the same rank of the peer group, whose layout is the same)."""
    loop = trainer._fit_loop
    module_state: dict[str, Any] = {}
    trainer.module.on_save_checkpoint(module_state)
    return {
        "model": trainer.module.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else {},
        "precision": trainer.strategy.precision.state_dict(),
        "loop": trainer.state.state_dict(),
        "rng": rng_state(),
        "data": loop.train_batches.state_dict(),
        "strategy": trainer.strategy.state_dict(),
        "module": module_state,
    }


def load_replica_state(trainer: Trainer, state: dict[str, Any]) -> None:
    """Continue from a peer's `replica_state`: parameters are copied bit for bit; the data position takes
    effect when the loop next begins its iterator (the loop does so right after a recovery). Callbacks keep
    their own state: it describes this group's run folder (its checkpoints, its timers), not the model."""
    trainer.module.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])  # the param groups' LR with it
    if trainer.lr_scheduler is not None and state["scheduler"]:
        trainer.lr_scheduler.load_state_dict(state["scheduler"])
    trainer.strategy.precision.load_state_dict(state["precision"])
    trainer.state.load_state_dict(state["loop"])
    set_rng_state(state["rng"])
    trainer._fit_loop.train_batches.load_state_dict(state["data"])
    trainer.strategy.load_state_dict(state["strategy"])
    trainer.module.on_load_checkpoint(state["module"])
    if trainer._fit_loop.progress is not None:
        trainer._fit_loop.progress.reset(trainer.global_step)
