"""ModelCheckpoint: periodic, atomic, validated checkpoints of the whole training state, keeping the best/newest k.

It decides when to save, whether and how to validate, and which checkpoints to keep; the files are the
Trainer's CheckpointManager's (trainer/checkpoint/manager.py: save, verify, set aside, prune own run only)."""

from __future__ import annotations

import dataclasses
import datetime
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks import checkpoint_names as names
from callbacks import checkpoint_schedule as schedule
from callbacks.base import Checkpoint
from callbacks.checkpoint_validation import Validation, not_finite, state_not_finite
from trainer import checkpoint as ckpt
from trainer import flags
from trainer.checkpoint import records
from trainer.checkpoint.records import SavedCheckpoint
from trainer.core.logging import log, rank_zero_info
from trainer.module import TrainModule

if TYPE_CHECKING:
    from trainer.trainer import Trainer


# every_n_steps="auto": the first save comes at the end of this step of the fit, timed; the steps before it
# time a step (the first one left out: it warms up)
AUTO_FIRST_SAVE_STEP = 3


class ModelNotFiniteError(RuntimeError):
    """The live model became non-finite: the fit ends (its checkpoints are set aside as bad)."""


class ModelCheckpoint(Checkpoint):
    """Save `<dirpath>/step-XXXXXXXX/` every `every_n_steps` optimizer steps and/or `every_n_minutes`, and
    (with `save_last`) at the end of fit. Each file's hashes, taken as it is written, go into the manifest.

    With `validate`, a checkpoint is *good* only after it was proven loadable
    (callbacks/checkpoint_validation.py): its hashes verified, then loaded into the live module (same
    processes, sharded the same way) and, when the module overrides `validation_step` and there is a
    validation batch (`validate_batch`, else the first batch of this rank's validation loader), its
    `validation_step` loss on it equal to the live model's at save time within `validate_atol` (0.0:
    bitwise); otherwise the checksums and the reload only, said once.
    `training_step` is never run: it may count, log or change state. A model that is not finite at save
    time is not reloaded: its checkpoint fails at once. A checkpoint that fails is renamed `bad-step-...`
    and the older good ones stay; `ckpt_path="last"` only ever resumes from good ones. With an async-saving
    strategy, validation happens once the background write finished (at the next save or the end of fit).

    Validation costs a read of the checkpoint and two forwards. `validate_budget` bounds it: the first
    checkpoint of a fit is always validated, a later one only while validation's total time stays within
    that share of the fit's time plus one free second (0.02: a large run is slowed by 2% at most, a small
    model validates every checkpoint); the others are checked by their hashes when resumed. None
    validates every checkpoint. Each save reports its cost: seconds, and % of the time since the previous
    checkpoint.

    A fit owns the folder it writes (trainer/checkpoint/run_folder.py): `dirpath` (default
    `<default_root_dir>/checkpoints`) while it holds no other run's checkpoints, else a new `dirpath/version_N`,
    named in one line; `dirpath` is the folder in use during a fit. A second live fit into it is refused.

    Keeps `save_top_k` good checkpoints: the newest ones, or with `monitor` the best by that metric
    (`mode` "min"/"max"; of equal values the older, as Lightning) plus always the newest. -1 keeps all.
    Nothing is deleted before a newer checkpoint is good, and only checkpoints of this run (its run id, in
    its own folder, as the folder says: never a path carried in loaded state) are ever deleted; a
    checkpoint a fit started from elsewhere is only read.

    A model that is not finite (a non-finite loss or weight) ends the fit with one line: since which step,
    and the last good checkpoint. A save that fails (a full disk: one line with the bytes needed and free)
    stops the fit (`on_save_error="stop"`, the default) or is reported and training goes on without that
    checkpoint (`"continue"`); the previous checkpoint is intact either way.

    `every_n_steps="auto"` with `mtbf_hours` (the job's mean time between failures) sets the interval from
    the failure rate by Young/Daly, sqrt(2 * C * MTBF) with C the measured cost of a save (the first one,
    made at step AUTO_FIRST_SAVE_STEP of the fit: what the loop stood still, the reload check included),
    in steps of the measured step time (the slowest rank's numbers); it logs the choice and the projected
    effective training time 1 - C/T - T/(2 MTBF) (strategies/plan/checkpoint_interval.py).

    Lightning's arguments mean what they mean there. With `monitor` and no step or time interval it saves
    after each validation (or each epoch's end, `every_n_epochs`, `save_on_train_epoch_end` as Lightning
    decides), keeping the top `save_top_k` by that value (0: none; -1: all) in `best_k_models`;
    `every_n_train_steps` is `every_n_steps`, `train_time_interval` is `every_n_minutes`. `filename`
    (`"{epoch}-{val_loss:.2f}"`, `auto_insert_metric_name`) names the checkpoint *directory*, `-v1`... when
    taken. `save_last`: True also saves at the end of fit and `last_model_path` is the newest checkpoint
    (always kept: it is what "last" resumes); "link" also keeps a `last` link to it. `save_weights_only`
    leaves the optimizer out (such a checkpoint loads for validate/test/predict and `load_from_checkpoint`,
    not to resume a fit). `best_model_path`, `best_model_score`, `best_k_models`, `kth_best_model_path`,
    `last_model_path` and `state_dict()` read as Lightning's, from this run's good checkpoints.
    """

    CHECKPOINT_NAME_LAST = "last"
    CHECKPOINT_JOIN_CHAR = names.JOIN_CHAR
    CHECKPOINT_EQUALS_CHAR = names.EQUALS_CHAR

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | str | None = True,
        save_top_k: int = 2,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: datetime.timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        *,
        every_n_steps: int | str | None = None,
        every_n_minutes: float | None = None,
        mtbf_hours: float | None = None,
        validate: bool = True,
        validate_atol: float = 0.0,
        validate_batch: Any = None,
        validate_budget: float | None = 0.02,
        on_save_error: str = "stop",
    ) -> None:
        steps, minutes, self.auto_interval = schedule.intervals(
            every_n_steps, every_n_train_steps, every_n_minutes, train_time_interval, mtbf_hours
        )
        self.every_n_epochs = schedule.epochs(every_n_epochs, monitor, steps, minutes)
        self.every_n_steps, self.every_n_minutes = steps, minutes
        if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < -1:
            raise ValueError(
                f"save_top_k={save_top_k!r} is invalid; allowed: -1 (keep all), 0 (none) or an int >= 1"
            )
        if save_last not in (True, False, None, "link"):
            raise ValueError(f"save_last={save_last!r} is invalid; allowed: True, False, None or 'link'")
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} is invalid; allowed: 'min' or 'max'")
        flags.check_number("validate_atol", validate_atol, 0)
        flags.check_number("validate_budget", validate_budget, 0, strict=True, allow_none=True)
        self.on_save_error = flags.check_choice("on_save_error", on_save_error, ("stop", "continue"))
        self._requested = Path(dirpath) if dirpath is not None else None  # the base of each fit's folder
        self.dirpath = self._requested
        self.filename = names.check_template(filename)
        self.auto_insert_metric_name = auto_insert_metric_name
        self.enable_version_counter = enable_version_counter
        self.verbose, self.save_weights_only = verbose, save_weights_only
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.save_last, self.save_top_k = save_last, save_top_k
        self.monitor, self.mode = monitor, mode
        self.validate, self.validate_atol, self.validate_batch = (
            validate,
            float(validate_atol),
            validate_batch,
        )
        self.validate_budget = validate_budget
        # the checkpoints kept, oldest first (trainer/checkpoint/records.py)
        self.saved: list[SavedCheckpoint] = []
        self.current_score: torch.Tensor | None = None  # the monitored value at the latest save
        self._last_save_time = time.monotonic()
        self._validation = Validation(validate, validate_budget, validate_batch, self.validate_atol)
        self._attempted_step: int | None = None  # the step last saved, good or bad: never saved twice
        self._training = False  # between on_train_start and on_train_end: validations there may save
        self._trained = False  # this fit started training (limit_train_batches=0 skips it: nothing saved)
        self.mtbf_hours = None if mtbf_hours is None else float(mtbf_hours)
        # every_n_steps="auto": what the interval was chosen from (the slowest rank's), set at the first save
        self.save_cost_s: float | None = None
        self.step_time_s: float | None = None
        self.interval_s: float | None = None  # Young/Daly's, in seconds of training
        self.effective_fraction: float | None = None
        self._step_ends: list[float] = []  # monotonic time at the end of each step of this fit, until then

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self.dirpath = self.base_dir(trainer)  # a fit then moves it to the folder it claims (run_folder)
        self._last_save_time = time.monotonic()
        self._validation = Validation(
            self.validate, self.validate_budget, self.validate_batch, self.validate_atol
        )
        self._attempted_step = None
        self._training = self._trained = False
        if self.auto_interval:
            self.every_n_steps, self._step_ends = None, []

    def base_dir(self, trainer: Trainer) -> Path:
        """The folder asked for (`dirpath`, else `<default_root_dir>/checkpoints`): a run's, or its parent."""
        return self._requested or Path(trainer.default_root_dir) / "checkpoints"

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self.saved = trainer.checkpoint_manager.own(self.dirpath)

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._training = self._trained = True

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._training = False

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        if self.auto_interval and self.every_n_steps is None and self._saves:
            self._step_ends.append(time.monotonic())
            if len(self._step_ends) == AUTO_FIRST_SAVE_STEP:
                self._save_and_choose_interval(trainer)
            return
        due = bool(self.every_n_steps) and trainer.global_step % self.every_n_steps == 0
        if self.every_n_minutes is not None:
            late = time.monotonic() - self._last_save_time >= 60 * self.every_n_minutes
            # clocks differ per rank: rank zero's decides (every rank must save at the same step)
            due |= trainer.strategy.any_rank(late and trainer.is_global_zero)
        if due and self._saves:
            self.save(trainer)

    def _save_and_choose_interval(self, trainer: Trainer) -> None:
        """every_n_steps="auto": save now, timed, then set the interval from that cost and the step time."""
        ends = self._step_ends
        step_s = (ends[-1] - ends[0]) / (len(ends) - 1)
        start = time.monotonic()
        self.save(trainer)
        chosen = schedule.young_daly(trainer, time.monotonic() - start, step_s, self.mtbf_hours)
        self.save_cost_s, self.step_time_s, self.interval_s, self.every_n_steps, self.effective_fraction = (
            chosen
        )

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Lightning's saving after a validation inside fit (not the sanity check, not `validate`)."""
        if self._training and not trainer.sanity_checking and not self._on_epoch_end(trainer):
            self._save_epoch(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._on_epoch_end(trainer):
            self._save_epoch(trainer)

    def _save_epoch(self, trainer: Trainer) -> None:
        """Save when `every_n_epochs` says this epoch is due (never twice at a step, nor at step 0)."""
        n = self.every_n_epochs
        if n and (trainer.current_epoch + 1) % n == 0 and trainer.global_step > 0 and self._saves:
            self.save(trainer)

    def _on_epoch_end(self, trainer: Trainer) -> bool:
        return schedule.saves_at_epoch_end(trainer, self.save_on_train_epoch_end)

    @property
    def _saves(self) -> bool:
        """Whether a due save writes anything: Lightning's `save_top_k=0` without `save_last` saves nothing."""
        return self.save_top_k != 0 or bool(self.save_last)

    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self.save_last and self._trained and not self._saved_already(trainer.global_step):
            self.save(trainer)
        trainer.checkpoint_manager.finish_writing()
        self._validate_written(trainer)

    def save(self, trainer: Trainer) -> Path:
        """Save a checkpoint of the current step now (on every rank), validate it, then prune."""
        score = trainer.callback_metrics.get(self.monitor) if self.monitor else None
        if self.monitor and score is None:
            raise KeyError(
                f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric; logged: "
                f"{', '.join(sorted(trainer.callback_metrics)) or 'none yet'}"
            )
        manager = trainer.checkpoint_manager
        if self._saved_already(trainer.global_step):  # say, by a Timer and by the schedule at the same step
            same = [c.path for c in self.saved if c.step == trainer.global_step]
            return same[-1] if same else manager.path_for(trainer.global_step, self.dirpath)
        path = self._path_for(trainer, score)
        self._attempted_step = trainer.global_step
        self.current_score = None if score is None else torch.tensor(_plain_score(score))
        manager.finish_writing()  # a background write still running completes first
        self._validate_written(trainer)
        reload = self._validation.due(trainer)
        entry = SavedCheckpoint(
            path, trainer.global_step, _plain_score(score), interval_s=time.monotonic() - self._last_save_time
        )
        if reload:
            reference, why, seconds = self._validation.reference(trainer)
            entry = dataclasses.replace(
                entry, good=False, reference=reference, not_finite=why, reference_s=seconds
            )
        else:
            # not reloaded, but a non-finite model is never kept as good
            why = not_finite(trainer, state_not_finite(trainer))
            entry = dataclasses.replace(entry, good=why is None, not_finite=why)
        # listed before writing, so the checkpoint's own copy of this state already knows about itself
        self.saved = [c for c in self.saved if c.path != path] + [entry]
        start = time.monotonic()
        try:
            manager.save(
                path,
                pending_validation=reload,
                meta={"score": _plain_score(score)},
                weights_only=self.save_weights_only,
            )
        except (ckpt.CheckpointError, OSError) as err:
            self.saved.remove(entry)
            if self.on_save_error == "stop":
                raise
            if trainer.is_global_zero:
                log.error(f"{err}; training goes on without it (ModelCheckpoint(on_save_error='continue'))")
            return path
        entry = self._update(entry, write_s=time.monotonic() - start)
        self._last_save_time = time.monotonic()
        if self.validate and not reload and entry.good:
            self._report(
                entry,
                f"reload check skipped: validation has cost {self._validation.spent_s:.2f} s of this fit and "
                f"the last one {self._validation.last_s:.2f} s, over validate_budget={self.validate_budget:g} "
                "of its time (the hashes are checked on resume)",
            )
        self._validate_written(trainer)
        if self.verbose and score is not None:
            kept = "as top " + str(self.save_top_k) if str(path) in self.best_k_models else "not in top k"
            rank_zero_info(
                f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: {self.monitor!r} is "
                f"{_plain_score(score):.5g} (best {float(self.best_model_score or score):.5g}), saved to "
                f"{path} ({kept})"
            )
        return path

    def _path_for(self, trainer: Trainer, score: Any) -> Path:
        """Where this save goes: `step-N` in the run's folder, or the `filename` template's free name."""
        if self.filename is None:
            return trainer.checkpoint_manager.path_for(trainer.global_step, self.dirpath)
        metrics = {k: _plain_score(v) for k, v in trainer.callback_metrics.items() if _is_number(v)}
        metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
        name = names.format_name(self.filename, metrics, self.auto_insert_metric_name)
        return names.free_name(self.dirpath, name, self.enable_version_counter)

    # ---- Lightning's views of what is kept ---------------------------------------------------------
    def _top_k(self) -> list[SavedCheckpoint]:
        """The good, scored checkpoints Lightning's `best_k_models` holds, best first (ties: the older)."""
        if self.monitor is None or self.save_top_k == 0:
            return []
        ranked = records.best_first(self.saved, self.mode)
        return ranked if self.save_top_k == -1 else ranked[: self.save_top_k]

    def _best(self) -> SavedCheckpoint | None:
        """The best good checkpoint by `monitor` (records.best: of equal scores the older); without a
        monitor the newest good one, as Lightning's best_model_path is then the last saved."""
        if self.monitor is None:
            return self._newest_good()
        return records.best(self.saved, self.mode) if self.save_top_k != 0 else None

    def _newest_good(self) -> SavedCheckpoint | None:
        return max((c for c in self.saved if c.good), key=lambda c: c.step, default=None)

    @property
    def best_k_models(self) -> dict[str, torch.Tensor]:
        """{path: monitored value} of the top `save_top_k` good checkpoints (empty without `monitor`)."""
        return {str(c.path): torch.tensor(c.score) for c in self._top_k()}

    @property
    def best_model_path(self) -> str:
        """The best good checkpoint by `monitor` (of equal scores the older; without one: the newest),
        or ""."""
        best = self._best()
        return str(best.path) if best is not None else ""

    @property
    def best_model_score(self) -> torch.Tensor | None:
        best = self._best() if self.monitor else None
        return torch.tensor(best.score) if best is not None else None

    @property
    def kth_best_model_path(self) -> str:
        """The worst of `best_k_models` (the next to go), or ""."""
        top = self._top_k()
        return str(top[-1].path) if top else ""

    @property
    def kth_value(self) -> torch.Tensor:
        top = self._top_k()
        worst = math.inf if self.mode == "min" else -math.inf
        return torch.tensor(top[-1].score if top else worst)

    @property
    def last_model_path(self) -> str:
        """With `save_last`: the newest good checkpoint (its `last` link with "link"), else ""."""
        newest = self._newest_good()
        if not self.save_last or newest is None:
            return ""
        link = Path(self.dirpath) / self.CHECKPOINT_NAME_LAST
        return str(link) if self.save_last == "link" and link.is_symlink() else str(newest.path)

    def state_dict(self) -> dict[str, Any]:
        """Lightning's keys; on resume they are read again from the run's own checkpoints in its folder."""
        return {
            "monitor": self.monitor,
            "best_model_score": self.best_model_score,
            "best_model_path": self.best_model_path,
            "current_score": self.current_score,
            "dirpath": str(self.dirpath),
            "best_k_models": self.best_k_models,
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": self.kth_value,
            "last_model_path": self.last_model_path,
        }

    def _report(self, entry: SavedCheckpoint, what: str) -> None:
        written = f"written in {entry.write_s:.2f} s ({_share(entry.write_s, entry)})"
        rank_zero_info(f"checkpoint {entry.path.name}: {written}; {what}")

    def _saved_already(self, step: int) -> bool:
        """A checkpoint of `step` is kept, or was tried in this fit and failed (it is not written twice)."""
        return self._attempted_step == step or any(c.step == step for c in self.saved)

    def _update(self, entry: SavedCheckpoint, **changes: Any) -> SavedCheckpoint:
        """`entry` with `changes`, put in its place in `saved`."""
        changed = dataclasses.replace(entry, **changes)
        self.saved = [changed if c is entry else c for c in self.saved]
        return changed

    # ---- validation ------------------------------------------------------------------------------
    def _validate_written(self, trainer: Trainer) -> None:
        """Validate every checkpoint that is completely written and not yet validated, then prune."""
        if not trainer.checkpoint_manager.writing:
            for entry in [c for c in self.saved if not c.good]:
                self._validate(trainer, entry)
        self._prune(trainer)

    def _validate(self, trainer: Trainer, entry: SavedCheckpoint) -> None:
        """The reload check of a written checkpoint: marked validated, or set aside as bad; a model whose
        weights are not finite ends the fit."""
        problem, report = self._validation.check(trainer, entry)
        if problem is None:
            trainer.checkpoint_manager.mark_validated(entry.path, report)
            seconds = report["seconds"]
            checks = ", ".join(report["checked"])
            self._report(
                self._update(entry, good=True, reference=None, reference_s=0.0),
                f"validated ({checks}) in {seconds:.2f} s ({_share(seconds, entry)})",
            )
        else:
            self.saved.remove(entry)
            trainer.checkpoint_manager.mark_bad(entry.path, problem)
        trainer.strategy.barrier(group="world")
        # non-finite weights: training on cannot bring them back; end the fit, naming what is left
        if entry.not_finite is not None and not_finite(trainer, state_not_finite(trainer)):
            newest = self._newest_good()
            last = newest.path.name if newest is not None else "none (no good checkpoint)"
            since = trainer.not_finite_since() or entry.step
            raise ModelNotFiniteError(
                f"the model is not finite since step {since}; last good checkpoint: {last}"
            )

    def on_load_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict[str, Any]) -> None:
        """Checkpoints newer than the restored step belong to a discarded future (a resume from an older
        one, a rollback): rename them `discarded-step-...` so that "last" can never go back to them."""
        self.saved = [c for c in self.saved if c.step <= trainer.global_step]
        self._attempted_step = None  # the steps after the restored one will be trained (and saved) again
        trainer.checkpoint_manager.discard_newer(trainer.global_step, self.dirpath)

    # ---- retention -------------------------------------------------------------------------------
    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._prune(trainer)  # the strategy has finished any checkpoint still being written

    def _prune(self, trainer: Trainer) -> None:
        """Delete what falls outside the top k, counting only good checkpoints: one still being written
        or validated never pushes a good one out."""
        manager = trainer.checkpoint_manager
        good = [c for c in self.saved if c.good and manager.is_complete(c.path)]
        stale = self._beyond_top_k(good)
        # the manager deletes only checkpoints of this run in this folder (the folder's word, not this list's)
        manager.prune([c.path for c in stale], self.dirpath)
        self.saved = [c for c in self.saved if c not in stale]
        newest = self._newest_good()
        if self.save_last == "link" and newest is not None:
            manager.link_last(Path(self.dirpath) / self.CHECKPOINT_NAME_LAST, newest.path)

    def _beyond_top_k(self, entries: list[SavedCheckpoint]) -> list[SavedCheckpoint]:
        if self.save_top_k == -1 or not entries:
            return []
        newest = max(entries, key=lambda c: c.step)
        # with a monitor, by records.ranked: one saved without the metric (by another saver of the run) last
        ranked = (
            records.ranked(entries, self.mode) if self.monitor else sorted(entries, key=lambda c: -c.step)
        )
        keep = ranked[: self.save_top_k] + [newest]
        return [c for c in entries if c not in keep]


def _plain_score(score: Any) -> float | None:
    """The monitored value as meta.json holds it."""
    return None if score is None else float(score)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def _share(seconds: float, entry: SavedCheckpoint) -> str:
    """'1.7% of the 300 s since the previous checkpoint' (or since the fit began)."""
    interval = entry.interval_s or 0.0
    pct = 100.0 * seconds / interval if interval > 0 else float("inf")
    return f"{pct:.1f}% of the {interval:.1f} s since the previous checkpoint"
