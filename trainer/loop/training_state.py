"""The run's training state as named parts, each with `state_dict`/`load_state_dict` (TorchTitan's `states`):
a checkpoint, a resume, a rollback and a replica's recovery each capture or restore a named subset of it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainer.core.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from callbacks.base import Callback
    from strategies.base import Strategy
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


# parts a checkpoint of an earlier version lacks (it saved none of them): loading it leaves them as they are
LATER_PARTS = ("outer_sync",)


class TrainingState:
    """Every part of a Trainer's training state by name; the only code that reads the loop's internals for
    a save or writes them back on a load."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def parts(self, *, local: bool = False) -> dict[str, Stateful]:
        """The parts, by name, as the running fit has them (module, optimizer and data change per fit).
        `local`: the RNG part takes no collective (for torchft's quorum thread)."""
        trainer = self._trainer
        fit = trainer._fit_loop
        return {
            "model": trainer.module,
            "optimizer": trainer.optimizer,  # its param groups' LR with it (fault tolerance's: one optimizer)
            "loop": trainer.state,
            "rng": RngStreams(trainer.strategy, local),
            "scheduler": Schedule(trainer),
            "precision": trainer.strategy.precision,
            "data": fit.train_batches if fit is not None else NoData(),
            "callbacks": CallbackStates(trainer.callbacks),
            "strategy": trainer.strategy,
            "module": ModuleExtras(trainer.module),
            "outer_sync": OuterWindow(fit.replicas if fit is not None else None, local),
        }

    def optimizers(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer] | None:
        """What the strategy writes and reads as a checkpoint's optimizer state: the fit's optimizer, or the list
        of them when a manually optimized module has several."""
        optimizers = self._trainer.optimizers
        return optimizers if len(optimizers) > 1 else self._trainer.optimizer

    def capture(self, names: Iterable[str], *, local: bool = False) -> dict[str, Any]:
        """The named parts' state (every rank calls it, unless `local`)."""
        parts = self.parts(local=local)
        return {name: parts[name].state_dict() for name in names}

    def restore(self, state: dict[str, Any], names: Iterable[str]) -> None:
        """Load the named parts of `state`, in the order named; the progress bar follows the step counter."""
        parts = self.parts(local=True)
        for name in names:
            if name in LATER_PARTS and name not in state:
                continue  # a checkpoint written before the part existed: it saved none
            parts[name].load_state_dict(state[name])
        fit = self._trainer._fit_loop
        if fit is not None and fit.progress is not None:
            fit.progress.reset(self._trainer.global_step)

    def restore_param_groups(self, read_state: Callable[[], dict[str, Any]]) -> None:
        """Before a resume loads the optimizer's state: the callbacks that add param groups during a fit
        (BaseFinetuning's `restore_param_groups`) re-add them from their saved state, so that the saved state
        fits the optimizer, as Lightning restores callbacks first. `read_state` reads the checkpoint's state
        only when such a callback is there (the strategy reads it again for everything else)."""
        owners = [cb for cb in self._trainer.callbacks if hasattr(cb, "restore_param_groups")]
        if not owners:
            return
        saved = read_state().get("callbacks", {})
        for cb in owners:
            if cb.state_key in saved:
                cb.restore_param_groups(self._trainer, saved[cb.state_key])

    def rewind_loop(self, saved: dict[str, Any]) -> None:
        """A rollback's loop counters: the step and the productive time of the checkpoint, one restart more;
        epoch, data position and what was seen go on (the batches since are not replayed)."""
        loop = self._trainer.state
        loop.global_step = saved["global_step"]
        loop.productive_s = saved.get("productive_s", 0.0)
        loop.restarts += 1

    def saving(self, checkpoint: dict[str, Any]) -> None:
        """The callbacks' `on_save_checkpoint` on a checkpoint's whole state, before it is written."""
        self._trainer._dispatch.callbacks("on_save_checkpoint", checkpoint)

    def loaded(self, checkpoint: dict[str, Any]) -> None:
        """The callbacks' `on_load_checkpoint` on a checkpoint's whole state, after it was restored."""
        self._trainer._dispatch.callbacks("on_load_checkpoint", checkpoint)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class RngStreams:
    """The RNG streams: every rank's in a checkpoint (gathered), this rank's alone when `local`."""

    def __init__(self, strategy: Strategy, local: bool) -> None:
        self.strategy, self.local = strategy, local

    def state_dict(self) -> list[Any]:
        return [rng_state()] if self.local else self.strategy.all_gather_object(rng_state(), group="world")

    def load_state_dict(self, rngs: list[Any]) -> None:
        """This rank's streams as saved (rank 0's when the world size changed, or the one of a peer's rank)."""
        rank, world = self.strategy.global_rank, self.strategy.world_size
        set_rng_state(rngs[rank] if len(rngs) == world else rngs[0])


class Schedule:
    """The LR scheduler's position. The Trainer's own schedule is rebuilt from this run's flags (a run may
    be extended): only its position is restored, and each group's LR recomputed from it."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        configs = self.trainer.lr_scheduler_configs
        if len(configs) > 1:  # a manually optimized module's schedulers
            return {"schedulers": [config.scheduler.state_dict() for config in configs]}
        scheduler = self.trainer.lr_scheduler
        return scheduler.state_dict() if scheduler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        configs = trainer.lr_scheduler_configs
        if len(configs) > 1:
            saved = state.get("schedulers", [])
            if len(saved) != len(configs):
                raise ValueError(
                    f"the checkpoint holds {len(saved)} lr scheduler states, configure_optimizers returned "
                    f"{len(configs)} schedulers; allowed: the schedulers the checkpointed run had"
                )
            for config, scheduler_state in zip(configs, saved, strict=True):
                config.scheduler.load_state_dict(scheduler_state)
            return
        scheduler, schedule = trainer.lr_scheduler, trainer._schedule
        if schedule is not None:
            scheduler.load_state_dict({**state, "lr_lambdas": [None] * len(trainer.optimizer.param_groups)})
            # a group a callback added during the fit (BaseFinetuning) is not the schedule's: its LR as saved
            for group, base in zip(trainer.optimizer.param_groups, scheduler.base_lrs, strict=False):
                group["lr"] = base * schedule(scheduler.last_epoch)
        elif state:
            scheduler.load_state_dict(state)


class CallbackStates:
    """Each callback's state under its `state_key`; a callback the saved run did not have keeps its own."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = callbacks

    def state_dict(self) -> dict[str, Any]:
        return {cb.state_key: cb.state_dict() for cb in self.callbacks}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for cb in self.callbacks:
            if cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])


class ModuleExtras:
    """What the module's `on_save_checkpoint` adds (Lightning's hook), given back to `on_load_checkpoint`."""

    def __init__(self, module: TrainModule) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        extras: dict[str, Any] = {}
        self.module.on_save_checkpoint(extras)
        return extras

    def load_state_dict(self, extras: dict[str, Any]) -> None:
        self.module.on_load_checkpoint(extras)


class OuterWindow:
    """DiLoCo's window of a fault-tolerant fit (fault_tolerance/outer_sync.py: its start weights and outer
    momentum); empty without one. A checkpoint (not `local`) holds it only for unsharded parameters, the same
    on every rank of the group; a peer's recovery sends each rank's own."""

    def __init__(self, replicas: Any, local: bool) -> None:
        self.outer = getattr(replicas, "outer", None)
        self.local = local

    def state_dict(self) -> dict[str, Any]:
        if self.outer is None or (self.outer.sharded and not self.local):
            return {}
        return self.outer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A saved window continues; none saved (no DiLoCo then, or sharded parameters): a new one begins."""
        if self.outer is not None and state:
            self.outer.load_state_dict(state)


class NoData:
    """The data position outside a fit: none to save."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RuntimeError("a data position loads only inside a fit, whose loader it describes")
