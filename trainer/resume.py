"""A run's checkpoints seen from the loop: save the training state, claim the run's folders, resume from
"last" or a path, roll back. Functions of the trainer; the Trainer's public methods delegate here."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from callbacks.checkpoint import ModelCheckpoint
from trainer import checkpoint as ckpt
from trainer import run_folder
from trainer.checkpoint import CheckpointError, step_dir_name
from trainer.logging import log, rank_zero_info
from trainer.rng import rng_state, set_rng_state
from trainer.step_log import plain

if TYPE_CHECKING:
    from trainer.trainer import Trainer


def save_checkpoint(
    trainer: Trainer,
    path: str | Path | None = None,
    *,
    pending_validation: bool = False,
    meta: dict[str, Any] | None = None,
) -> Path:
    """`Trainer.save_checkpoint`: the whole training state to `path`, atomically."""
    path = Path(path) if path is not None else trainer.checkpoint_dir / step_dir_name(trainer.global_step)
    if trainer.run_id is None:  # a save outside a fit (one process): a run of its own
        trainer.run_id = run_folder.new_run_id()
    loop = trainer._fit_loop
    owner = {"run_id": trainer.run_id, "writer": trainer._writer or run_folder.this_writer()}
    state: dict[str, Any] = {
        "loop": trainer.state.state_dict(),
        "rng": trainer.strategy.all_gather_object(rng_state(), group="world"),
        "scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else {},
        "precision": trainer.strategy.precision.state_dict(),
        "data": loop.train_batches.state_dict() if loop is not None else {},
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "strategy": trainer.strategy.state_dict(),
        "module": {},
        "hyper_parameters": plain(dict(trainer.module.hparams)),
        "meta": {**owner, **({"pending_validation": True} if pending_validation else {}), **(meta or {})},
    }
    trainer.module.on_save_checkpoint(state["module"])
    trainer._dispatch.callbacks("on_save_checkpoint", state)
    trainer.strategy.save_checkpoint(path, trainer.module, trainer.optimizer, state)
    return path


def rollback(trainer: Trainer, before_step: int | None = None) -> Path:
    """`Trainer.rollback`: the training state (not the data stream) back to the newest good checkpoint."""
    path, skipped = ckpt.find_last_good(
        trainer.checkpoint_dir,
        before_step,
        trainer.strategy.io_part,
        agree_on(trainer, trainer.checkpoint_dir),
        trainer.allow_unverified_checkpoints,
    )
    if skipped and trainer.is_global_zero:
        log.warning("".join(f"rollback: skipped {line}\n" for line in skipped).rstrip())
    if path is None:
        raise CheckpointError(
            f"rollback needs a good checkpoint{'' if before_step is None else f' before step {before_step}'}; "
            f"there is none in {trainer.checkpoint_dir}"
        )
    state = trainer.strategy.load_checkpoint(path, trainer.module, trainer.optimizer)
    loop = state["loop"]
    trainer.state.global_step, trainer.state.productive_s = loop["global_step"], loop.get("productive_s", 0.0)
    trainer.state.restarts += 1
    restore_rng(trainer, state)
    restore_schedule(trainer, state)
    loop = trainer._fit_loop
    if loop is not None and loop.progress is not None:
        loop.progress.reset(trainer.global_step)
    trainer._dispatch.callbacks("on_load_checkpoint", state)
    return path


def checkpoint_dir(trainer: Trainer) -> Path:
    """`Trainer.checkpoint_dir`: the folder this fit claimed, else the newest run's (what "last" reads)."""
    if trainer._run_folder is not None:
        return trainer._run_folder
    saver = trainer.checkpoint_callback
    return run_folder.newest(
        saver.base_dir(trainer) if saver is not None else trainer.default_root_dir / "checkpoints"
    )


def claim_run_folders(trainer: Trainer, ckpt_path: Any) -> None:
    """Rank zero picks and locks the folder of each ModelCheckpoint, before anything is trained (a fresh
    run never shares one with an earlier run; a second live fit is refused); every rank learns the
    folders and the run id."""
    savers = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    claimed: Any = None
    if trainer.is_global_zero:
        try:
            claimed = run_folder.claim([cb.base_dir(trainer) for cb in savers], ckpt_path, trainer._locks)
        except (run_folder.FolderInUse, OSError) as err:
            claimed = str(err)
    claimed = trainer.strategy.broadcast_object(claimed)
    if isinstance(claimed, str):
        raise run_folder.FolderInUse(claimed)
    for cb, folder in zip(savers, claimed.folders, strict=True):
        cb.dirpath = Path(folder)
    trainer._run_folder = Path(claimed.folders[0]) if savers else None
    trainer.run_id, trainer._writer = claimed.run_id, claimed.writer
    for line in claimed.notes if trainer.is_global_zero else ():
        log.warning(line)


def load_checkpoint(trainer: Trainer, ckpt_path: Any, load: Any) -> Path | None:
    """Verify (every rank hashes its share) and `load(path)` the checkpoint `ckpt_path` names; "last" is
    the newest good one of this run's folder, falling back past any that fails to load, each named.
    Returns the checkpoint loaded, or None (nothing to resume)."""
    if ckpt_path is None:
        return None
    strategy, allow = trainer.strategy, trainer.allow_unverified_checkpoints
    if ckpt_path != "last":  # fail early, on every rank, with what is wrong with the files
        ckpt.check_good(ckpt_path, strategy.io_part, agree_on(trainer, Path(ckpt_path)), allow)
        load(Path(ckpt_path))
        return Path(ckpt_path)
    folder, before, refused, failed = trainer.checkpoint_dir, None, [], False
    while True:
        found, skipped = ckpt.find_last_good(
            folder, before, strategy.io_part, agree_on(trainer, ckpt.find_last(folder)), allow
        )
        refused += skipped
        if found is None:
            break
        problem = None
        try:
            load(found)
        except CheckpointError as err:
            problem = str(err)
        problem = strategy.agree(problem)
        if problem is None:
            break
        refused.append(f"{found.name}: failed to load ({problem})")
        before, failed = ckpt.read_meta(found)["step"], True
    if found is None and failed:  # the model is half-loaded now: starting from scratch would be wrong
        raise CheckpointError(f"ckpt_path='last': no checkpoint in {folder} loads; " + "; ".join(refused))
    if found is None:
        why = f"no checkpoint in {folder} is good" if refused else f"no checkpoint in {folder} yet"
        line = f"ckpt_path='last': {why}, starting from scratch"
    else:  # the line is rank zero's, read from its files (every meta has a step)
        meta = ckpt.read_meta(found)
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(meta["time"])) if "time" in meta else "?"
        line = f"resuming from {found}: step {meta['step']}, saved {saved}"
    if not refused:
        rank_zero_info(line)
    elif trainer.is_global_zero:  # what was refused, and why, is worth a warning
        log.warning("".join(f"ckpt_path='last': skipped {s}\n" for s in refused) + line)
    return found


def agree_on(trainer: Trainer, ckpt_dir: Path | None) -> ckpt.Agree:
    """How the ranks combine their verdicts on a checkpoint, each having hashed its share; the waits
    are sized to that share of `ckpt_dir`'s bytes (the newest candidate)."""
    trainer.strategy.begin_io(ckpt.manifest_bytes(ckpt_dir) // trainer.strategy.world_size)
    return trainer.strategy.agree


def restore_rng(trainer: Trainer, state: dict[str, Any]) -> None:
    """This rank's RNG streams as saved (rank 0's when the world size changed)."""
    rngs = state["rng"]
    set_rng_state(rngs[trainer.strategy.global_rank] if len(rngs) == trainer.strategy.world_size else rngs[0])


def restore(trainer: Trainer, path: Path) -> None:
    """Everything a resumed fit continues from: model, optimizer, loop, RNG, schedule, data, callbacks."""
    state = trainer.strategy.load_checkpoint(path, trainer.module, trainer.optimizer)
    trainer.state.load_state_dict(state["loop"])
    restore_rng(trainer, state)
    restore_schedule(trainer, state)
    trainer._fit_loop.train_batches.load_state_dict(state["data"])
    trainer.strategy.load_state_dict(state.get("strategy", {}))
    for cb in trainer.callbacks:
        if cb.state_key in state["callbacks"]:
            cb.load_state_dict(state["callbacks"][cb.state_key])
    trainer.module.on_load_checkpoint(state["module"])
    trainer._dispatch.callbacks("on_load_checkpoint", state)


def restore_schedule(trainer: Trainer, state: dict[str, Any]) -> None:
    """The LR schedule's position and the gradient scaler, from a checkpoint's state."""
    if trainer._schedule is not None:
        # our schedule is rebuilt from this run's flags (a run may be extended); only its position is restored
        trainer.lr_scheduler.load_state_dict(
            {**state["scheduler"], "lr_lambdas": [None] * len(trainer.optimizer.param_groups)}
        )
        for group, base in zip(trainer.optimizer.param_groups, trainer.lr_scheduler.base_lrs, strict=True):
            group["lr"] = base * trainer._schedule(trainer.lr_scheduler.last_epoch)
    elif state["scheduler"]:
        trainer.lr_scheduler.load_state_dict(state["scheduler"])
    trainer.strategy.precision.load_state_dict(state["precision"])
