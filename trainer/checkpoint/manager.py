"""CheckpointManager: the one owner of a run's checkpoint folders and of every file operation on them.

It knows the run (its id, its writer) and the folders it claimed; it saves the training state through the
strategy, lists this run's checkpoints, resolves "last" and "best", verifies, marks validated or sets
aside, prunes, resumes and rolls back. ModelCheckpoint decides *when* to save and *what* to keep and asks
this object to do it; the strategy writes and reads a checkpoint's layout (whole files, DCP shards,
ZeRO-1 slices). What it guarantees: nothing it deletes or renames was written by another run, and nothing
it deletes lies outside the folder it was asked about (the folder's word, never a path from loaded state).
Every method is called on every rank (the checks are split over the ranks); rank zero touches the files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks.checkpoint import ModelCheckpoint
from trainer import checkpoint as ckpt
from trainer.checkpoint import CheckpointError, run_folder, step_dir_name
from trainer.checkpoint.layout import unfinished
from trainer.checkpoint.records import SavedCheckpoint, best_first
from trainer.checkpoint.weights import read_checkpoint
from trainer.core.logging import log, rank_zero_info
from trainer.loggers.base import plain
from trainer.module import not_plain

if TYPE_CHECKING:
    from trainer.trainer import Trainer

# The parts of the Trainer's `training_state` a checkpoint holds beside model and optimizer (which the
# strategy writes, sharded as they are), in the order a resume loads them
CHECKPOINT_PARTS = (
    "loop", "rng", "scheduler", "precision", "data", "strategy", "callbacks", "module", "outer_sync",
)  # fmt: skip
# What a rollback puts back beside model and optimizer: the data stream goes on, the loop counters are rewound
ROLLBACK_PARTS = ("rng", "scheduler", "precision")


class CheckpointManager:
    """The checkpoints of the Trainer's runs: one per Trainer, its folders and run id set by each fit's `claim`."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.run_id: str | None = None  # this fit's (a resumed run's own), written into each checkpoint
        self._writer: dict[str, Any] | None = None  # rank zero's host and pid: who writes this run's files
        self._claimed: Path | None = None  # the folder this fit claimed (trainer/checkpoint/run_folder.py)
        self._locks: list[run_folder.FolderLock] = []
        self._said_last = False  # that a `last` that is no link was left alone

    # ---- the run's folders -----------------------------------------------------------------------
    @property
    def savers(self) -> list[ModelCheckpoint]:
        """The run's ModelCheckpoints, each writing to a folder of its own."""
        return [cb for cb in self._trainer.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def saver(self) -> ModelCheckpoint | None:
        """The first ModelCheckpoint: its folder is the run's (`folder`)."""
        return next(iter(self.savers), None)

    @property
    def claimed(self) -> Path | None:
        """The folder this fit claimed (None before the claim, or without a ModelCheckpoint)."""
        return self._claimed

    @property
    def folder(self) -> Path:
        """The folder this fit claimed, else the newest run's under the ModelCheckpoint's dirpath or
        `<default_root_dir>/checkpoints` (what "last" reads)."""
        if self._claimed is not None:
            return self._claimed
        saver = self.saver
        trainer = self._trainer
        return run_folder.newest(
            saver.base_dir(trainer) if saver is not None else trainer.default_root_dir / "checkpoints"
        )

    def claim(self, ckpt_path: Any) -> None:
        """Rank zero picks and locks the folder of each ModelCheckpoint, before anything is trained (a fresh
        run never shares one with an earlier run; a second live fit is refused); every rank learns the
        folders and the run id."""
        trainer, savers = self._trainer, self.savers
        claimed: Any = None
        if trainer.is_global_zero:
            try:
                claimed = run_folder.claim([cb.base_dir(trainer) for cb in savers], ckpt_path, self._locks)
            except (run_folder.FolderInUse, OSError) as err:
                claimed = str(err)
        claimed = trainer.strategy.broadcast_object(claimed)
        if isinstance(claimed, str):
            raise run_folder.FolderInUse(claimed)
        for cb, folder in zip(savers, claimed.folders, strict=True):
            cb.dirpath = Path(folder)
        self._claimed = Path(claimed.folders[0]) if savers else None
        self.run_id, self._writer = claimed.run_id, claimed.writer
        for line in claimed.notes if trainer.is_global_zero else ():
            log.warning(line)

    def release(self) -> None:
        """Unlock this fit's folders (after the strategy completed the checkpoints still being written)."""
        for lock in self._locks:
            lock.release()
        self._locks = []

    # ---- this run's checkpoints ------------------------------------------------------------------
    def path_for(self, step: int, folder: Path | None = None) -> Path:
        """Where the checkpoint of `step` goes in `folder` (default: the run's)."""
        return (self.folder if folder is None else Path(folder)) / step_dir_name(step)

    def own(self, folder: Path) -> list[SavedCheckpoint]:
        """Each completed checkpoint of this run in `folder` (its step and score as meta.json records them),
        oldest first: those whose meta.json names this run's id (a resumed run's earlier saves), never
        ones of another run or from another folder. Good: validated, or never awaiting validation."""
        own = []
        for path in reversed(ckpt.completed(folder)):
            try:
                meta = ckpt.read_meta(path)
            except CheckpointError:
                continue  # incomplete: not this run's to count (or delete)
            if meta.get("run_id") is None or meta.get("run_id") != self.run_id:
                continue
            good = (path / ckpt.VALIDATED_FILE).exists() or not meta.get("pending_validation")
            own.append(SavedCheckpoint(path, meta["step"], meta.get("score"), good))
        return own

    @staticmethod
    def is_complete(path: Path) -> bool:
        """Whether the checkpoint directory is complete (it has its meta.json)."""
        return (Path(path) / ckpt.META_FILE).exists()

    def resolve(
        self, which: str = "last", before_step: int | None = None, mode: str = "min"
    ) -> tuple[Path | None, list[str]]:
        """(the checkpoint `which` names in the run's folder, verified, or None; one line per newer or
        better one skipped and why). "last": the newest good one (of a step < `before_step`); "best": this
        run's good one with the best score meta.json records, by records.best_first (`mode` "min"/"max";
        of equal ones the older, as ModelCheckpoint's best_model_path); unscored ones are not candidates."""
        if which == "last":
            return self._last_good(self.folder, before_step)
        if which != "best" or mode not in ("min", "max"):
            raise ValueError(
                f"resolve({which!r}, mode={mode!r}); allowed: 'last' or 'best', mode 'min' or 'max'"
            )
        skipped = []
        for entry in best_first(self.own(self.folder), mode):
            if before_step is not None and entry.step >= before_step:
                continue
            why = self.verify(entry.path, allow_unverified=self._trainer.allow_unverified_checkpoints)
            if why is None:
                return entry.path, skipped
            skipped.append(f"{entry.path.name}: {why}")
        return None, skipped

    def verify(self, path: Path, validated: bool = True, allow_unverified: bool = False) -> str | None:
        """Why the checkpoint is not good (each rank hashes its share; the answer is agreed), or None.
        `validated` False: a checkpoint still awaiting its validation may pass."""
        why = ckpt.problem(path, self._trainer.strategy.io_part, validated, allow_unverified)
        return self._agreement(path)(why)

    def _last_good(self, folder: Path, before_step: int | None) -> tuple[Path | None, list[str]]:
        return ckpt.find_last_good(
            folder,
            before_step,
            self._trainer.strategy.io_part,
            self._agreement(ckpt.find_last(folder)),
            self._trainer.allow_unverified_checkpoints,
        )

    def _agreement(self, sized_by: Path | None) -> ckpt.Agree:
        """How the ranks combine their verdicts on a checkpoint, each having hashed its share; the waits
        are sized to that share of `sized_by`'s bytes (the newest candidate)."""
        strategy = self._trainer.strategy
        strategy.begin_io(ckpt.manifest_bytes(sized_by) // strategy.world_size)
        return strategy.agree

    # ---- writing ---------------------------------------------------------------------------------
    def save(
        self,
        path: str | Path | None = None,
        *,
        pending_validation: bool = False,
        meta: dict[str, Any] | None = None,
        weights_only: bool = False,
    ) -> Path:
        """The whole training state (model, optimizer, schedule, loop, RNG, data position, callbacks) to
        `path` (default: the run's folder, `step-N`), atomically, through the strategy; `weights_only`:
        without the optimizer (it cannot resume a fit). The module's hparams go in with it (those that are
        not plain values are named, for `load_from_checkpoint` to ask for)."""
        trainer = self._trainer
        path = Path(path) if path is not None else self.path_for(trainer.global_step)
        if trainer.is_global_zero:  # the rows logged up to this checkpoint reach their files first
            for lg in trainer.loggers:
                lg.save()
        if self.run_id is None:  # a save outside a fit (one process): a run of its own
            self.run_id = run_folder.new_run_id()
        owner = {"run_id": self.run_id, "writer": self._writer or run_folder.this_writer()}
        state: dict[str, Any] = {
            **trainer.training_state.capture(CHECKPOINT_PARTS),
            # the keys a callback written for Lightning reads in on_save/on_load_checkpoint (Lightning's values)
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "hyper_parameters": plain(dict(trainer.module.hparams)),
            "hyper_parameters_not_saved": not_plain(trainer.module.hparams),
            "meta": {
                **owner,
                **({"pending_validation": True} if pending_validation else {}),
                **({"weights_only": True} if weights_only else {}),
                **(meta or {}),
            },
        }
        trainer.training_state.saving(state)
        optimizer = None if weights_only else trainer.training_state.optimizers()
        trainer.strategy.save_checkpoint(path, trainer.module, optimizer, state)
        return path

    def save_as(self, path: str | Path, weights_only: bool = False) -> Path:
        """`Trainer.save_checkpoint(path)`: the checkpoint directory `path`; a name that looks like a file
        (`example.ckpt`) is said, once, to be a directory, and what reads it."""
        path = Path(path)
        saved = self.save(path, weights_only=weights_only)
        if path.suffix and self._trainer.is_global_zero:
            rank_zero_info(
                f"{path} is a checkpoint directory (model, state and manifest files, hashed), not one file: "
                "TrainModule.load_from_checkpoint, ckpt_path= and `trainer export` read it as it is"
            )
        return saved

    def link_last(self, link: Path, target: Path) -> None:
        """Point the `last` link in a run's folder at `target` (rank zero, atomically). Only a link is ever
        replaced: a file or directory of that name is left alone, and said once."""
        if not self._trainer.is_global_zero:
            return
        if link.exists() and not link.is_symlink():
            if not self._said_last:
                self._said_last = True
                log.warning(
                    f"{link} exists and is no link; it is left alone (no `last` link in {link.parent})"
                )
            return
        tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        os.symlink(target.name, tmp)
        os.replace(tmp, link)

    @property
    def writing(self) -> bool:
        """Whether a checkpoint is still being written in the background (an async-saving strategy)."""
        return self._trainer.strategy.checkpoint_in_progress

    def finish_writing(self) -> None:
        """Wait for a checkpoint still being written in the background to complete."""
        self._trainer.strategy.finish_checkpoint()

    def mark_validated(self, path: Path, report: dict[str, Any]) -> None:
        """Record that the checkpoint passed validation (rank zero writes `validated.json`)."""
        if self._trainer.is_global_zero:
            ckpt.mark_validated(path, report)

    def mark_bad(self, path: Path, problem: str) -> None:
        """Set a checkpoint that failed validation aside as `bad-step-...` (kept for inspection), in one line."""
        if self._trainer.is_global_zero:
            bad = ckpt.mark_bad(path) if path.exists() else path
            log.error(
                f"checkpoint {path.name} {problem}; moved to {bad.name}, the older good checkpoints are kept"
            )

    def prune(self, paths: list[Path], folder: Path) -> None:
        """Delete those of `paths` that are this run's checkpoints in `folder` (the folder's word: meta.json's
        run id); any other is left alone."""
        if not self._trainer.is_global_zero:
            return
        for path in map(Path, paths):
            owner = ckpt.run_of(path)
            if path.parent == folder and owner is not None and owner == self.run_id:
                shutil.rmtree(path, ignore_errors=True)

    def discard_newer(self, step: int, folder: Path) -> None:
        """This run's checkpoints in `folder` newer than `step` belong to a discarded future (a resume from an
        older one, one that starts again at step 0, a rollback): rename them `discarded-step-...` so that
        "last" can never go back to them, nor a save of their step find its name taken; complete or not, and
        so are the directories there without a usable meta.json (never completed, or damaged: nobody's)."""
        trainer = self._trainer
        if trainer.is_global_zero:
            for path in ckpt.newer_than(folder, step):
                owner = ckpt.run_of(path)
                damaged = unfinished(path) if owner is None else None
                if owner != self.run_id and damaged is None:
                    continue  # another run's, or no directory this run can read: not its future to discard
                target = ckpt.move_aside(path, "discarded")
                why = f" ({damaged})" if damaged else ""
                log.warning(
                    f"{path.name}{why} is newer than step {step}, where the run goes on: moved to {target.name}"
                )
        trainer.strategy.barrier(group="world")  # every rank lists the folder after this (ModelCheckpoint)

    # ---- reading ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def trial_load(self, path: Path) -> Iterator[None]:
        """Load the checkpoint's weights into the live module for the body of the `with`, then put the live
        values back (stashed on the CPU) and reshard: the module ends as it began."""
        trainer = self._trainer
        stash = stash_weights(trainer.module)
        try:
            trainer.strategy.load_checkpoint(path, trainer.module, None)
            yield
        finally:
            put_back_weights(stash)
            trainer.strategy.reshard(trainer.module)

    def resume(self, ckpt_path: Any) -> Path | None:
        """Everything a fit continues from (model, optimizer, loop, RNG, schedule, data, callbacks), out of
        the checkpoint `ckpt_path` names; returns it, or None (nothing to resume). "last" finding none good
        starts the run again at step 0: its checkpoints there are set aside as a restored one's newer are."""
        found = self._load(ckpt_path, self._restore)
        if found is None and ckpt_path == "last":
            for folder in dict.fromkeys(Path(cb.dirpath) for cb in self.savers):
                self.discard_newer(0, folder)
        return found

    def load_model(self, ckpt_path: Any) -> Path | None:
        """The module's weights (for validate/test/predict) out of the checkpoint `ckpt_path` names."""
        trainer = self._trainer

        def load(path: Path) -> None:
            ckpt.check_pickled_files(path, ckpt.read_meta(path).get("manifest", {}))  # files it never reads
            trainer.strategy.load_checkpoint(path, trainer.module, None)

        return self._load(ckpt_path, load, "loading")

    def _load(self, ckpt_path: Any, load: Callable[[Path], Any], verb: str = "resuming") -> Path | None:
        """Verify (every rank hashes its share) and `load(path)` the checkpoint `ckpt_path` names; "last" is
        the newest good one of this run's folder, falling back past any that fails to load, each named."""
        if ckpt_path is None:
            return None
        trainer = self._trainer
        strategy, allow = trainer.strategy, trainer.allow_unverified_checkpoints
        if ckpt_path == "best":
            ckpt_path = self._best()
        if ckpt_path != "last":  # fail early, on every rank, with what is wrong with the files
            ckpt.check_good(ckpt_path, strategy.io_part, self._agreement(Path(ckpt_path)), allow)
            load(Path(ckpt_path))
            return Path(ckpt_path)
        folder, before, refused, failed = self.folder, None, [], False
        while True:
            found, skipped = self._last_good(folder, before)
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
            # its directory's step, not meta.json's (not hashed: edited to an older one's, it would hide that one)
            before, failed = ckpt.step_of(found), True
        if found is None and failed:  # the model is half-loaded now: starting from scratch would be wrong
            raise CheckpointError(f"ckpt_path='last': no checkpoint in {folder} loads; " + "; ".join(refused))
        if found is None:
            why = f"no checkpoint in {folder} is good" if refused else f"no checkpoint in {folder} yet"
            line = f"ckpt_path='last': {why}, starting from scratch"
        else:  # the line is rank zero's, read from its files (every meta has a step)
            meta = ckpt.read_meta(found)
            saved = (
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(meta["time"])) if "time" in meta else "?"
            )
            line = f"{verb} from {found}: step {meta['step']}, saved {saved}"
        if not refused:
            rank_zero_info(line)
        elif trainer.is_global_zero:  # what was refused, and why, is worth a warning
            log.warning("".join(f"ckpt_path='last': skipped {s}\n" for s in refused) + line)
        return found

    def _best(self) -> Path:
        """What `ckpt_path="best"` names: the run's ModelCheckpoint's best good checkpoint by its monitor
        (without one: the newest good one, as Lightning's best_model_path is then the last saved)."""
        saver = self.saver
        if saver is None or self.run_id is None:
            raise CheckpointError(
                "ckpt_path='best' needs a fit of this Trainer with a ModelCheckpoint; allowed here: 'last' or "
                "a checkpoint directory"
            )
        if saver.save_top_k == 0:  # Lightning refuses it too: `best_model_path` is "" then
            raise CheckpointError(
                "ckpt_path='best': the ModelCheckpoint keeps no best checkpoint (save_top_k=0); allowed: 'last' "
                "or a checkpoint directory"
            )
        found, skipped = self.resolve("best" if saver.monitor else "last", mode=saver.mode)
        if skipped and self._trainer.is_global_zero:
            log.warning("".join(f"ckpt_path='best': skipped {line}\n" for line in skipped).rstrip())
        if found is None:
            raise CheckpointError(
                f"ckpt_path='best': no good checkpoint of this run in {self.folder} records "
                f"{saver.monitor or 'a step'}; allowed: 'last' or a checkpoint directory"
            )
        rank_zero_info(f"ckpt_path='best': {found}")
        return found

    def full_state_dict(self, ckpt_path: str | Path = "last") -> dict[str, torch.Tensor]:
        """The full model weights of the checkpoint `ckpt_path` names ("last", "best" or a directory), read
        in this process (no process group: any rank may call it, alone)."""
        if ckpt_path == "best":  # the saver's view: the same on every rank, no collective to agree on it
            path = Path(self.saver.best_model_path) if self.saver is not None else None
            if path is None or not self.saver.best_model_path:
                raise CheckpointError(
                    "ckpt_path='best': this Trainer's ModelCheckpoint has no best checkpoint (it needs a fit "
                    "with one); allowed: 'last' or a checkpoint directory"
                )
        elif ckpt_path == "last":
            path, _ = ckpt.find_last_good(
                self.folder, allow_unverified=self._trainer.allow_unverified_checkpoints
            )
            if path is None:
                raise CheckpointError(f"ckpt_path='last': no good checkpoint in {self.folder}")
        else:
            path = Path(ckpt_path)
        return read_checkpoint(path)[0]

    def rollback(self, before_step: int | None = None) -> Path:
        """The training state (not the data stream) back to the newest good checkpoint (of a step <
        `before_step`): model, optimizer, RNG streams, LR schedule and step counter."""
        trainer = self._trainer
        path, skipped = self.resolve("last", before_step)
        if skipped and trainer.is_global_zero:
            log.warning("".join(f"rollback: skipped {line}\n" for line in skipped).rstrip())
        if path is None:
            raise CheckpointError(
                f"rollback needs a good checkpoint{'' if before_step is None else f' before step {before_step}'}; "
                f"there is none in {self.folder}"
            )
        _refuse_weights_only(path, "rollback")
        state = trainer.strategy.load_checkpoint(path, trainer.module, trainer.training_state.optimizers())
        trainer.training_state.rewind_loop(state["loop"])
        trainer.training_state.restore(state, ROLLBACK_PARTS)
        trainer.training_state.loaded(state)
        return path

    def _restore(self, path: Path) -> None:
        """Everything a resumed fit continues from: model, optimizer, loop, RNG, schedule, data, callbacks."""
        trainer = self._trainer
        _refuse_weights_only(path, "fit")
        trainer.training_state.restore_param_groups(lambda: ckpt.load_torch_file(path / ckpt.STATE_FILE))
        state = trainer.strategy.load_checkpoint(path, trainer.module, trainer.training_state.optimizers())
        trainer.training_state.restore(state, CHECKPOINT_PARTS)
        trainer.training_state.loaded(state)


def _refuse_weights_only(path: Path, what: str) -> None:
    """CheckpointError before anything loads when the checkpoint holds no optimizer state to continue from."""
    if ckpt.read_meta(path).get("weights_only"):
        raise CheckpointError(
            f"checkpoint '{path}' holds the weights only (save_weights_only): {what} cannot continue from it; "
            "allowed: validate/test/predict(ckpt_path=...) or TrainModule.load_from_checkpoint",
            reason="weights only: no optimizer state to resume",
        )


def stash_weights(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CPU copies of this rank's part of every state-dict tensor, to put back after a trial load (or the
    tuner's trial steps)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in module.state_dict().values()]
    return [(t, t.detach().to("cpu", copy=True)) for t in local]


def put_back_weights(stash: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy what `stash_weights` kept back into the module's tensors, in place."""
    with torch.no_grad():
        for target, saved in stash:
            target.copy_(saved)
