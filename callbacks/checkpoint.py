"""ModelCheckpoint: periodic, atomic, validated checkpoints of the whole training state, keeping the best/newest k.

It decides when to save, whether and how to validate, and which checkpoints to keep; the files are the
Trainer's CheckpointManager's (trainer/checkpoint/manager.py: save, verify, set aside, prune own run only)."""

from __future__ import annotations

import datetime
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks import checkpoint_names as names
from callbacks.base import Callback
from strategies.plan.checkpoint_interval import effective_fraction, young_daly_interval
from trainer import checkpoint as ckpt
from trainer import flags
from trainer.core.dtensors import local_part
from trainer.core.logging import log, rank_zero_info
from trainer.core.rng import isolated_rng
from trainer.module import TrainModule

if TYPE_CHECKING:
    from trainer.trainer import Trainer


FREE_VALIDATION_S = 1.0  # validation time a fit may always spend: small models validate every checkpoint
# every_n_steps="auto": the first save comes at the end of this step of the fit, timed; the steps before it
# time a step (the first one left out: it warms up)
AUTO_FIRST_SAVE_STEP = 3


class ModelNotFiniteError(RuntimeError):
    """The live model became non-finite: the fit ends (its checkpoints are set aside as bad)."""


class ModelCheckpoint(Callback):
    """Save `<dirpath>/step-XXXXXXXX/` every `every_n_steps` optimizer steps and/or `every_n_minutes`, and
    (with `save_last`) at the end of fit. Each file's hashes, taken as it is written, go into the manifest.

    With `validate`, a checkpoint is *good* only after it was proven loadable: the ranks verify its
    hashes (each its share), then every rank loads the checkpoint into the live module (same processes,
    sharded the same way; the live values are stashed on the CPU and put back after). When the module overrides
    `validation_step` and there is a validation batch (`validate_batch`, else the first batch of this
    rank's validation loader), the reloaded model's `validation_step` loss on it must also equal the live
    model's at save time within `validate_atol` (0.0: bitwise). Otherwise (no validation data, an empty
    loader, no `validation_step`) it checks the checksums and the reload only, and says so once.
    `training_step` is never run: it may count, log or change state. A model that is not finite at save
    time (a non-finite live loss; without a loss, a non-finite parameter or buffer) is not reloaded: its
    checkpoint fails at once. A checkpoint that fails is renamed `bad-step-...` and the older good ones
    stay; `ckpt_path="last"` only ever resumes from good ones. With an async-saving strategy, validation
    happens once the background write finished (at the next save or the end of fit).

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
    (`mode` "min"/"max") plus always the newest. -1 keeps all. Nothing is deleted before a newer
    checkpoint is good, and only checkpoints of this run (its run id, in its own folder, as the folder
    says: never a path carried in loaded state) are ever deleted; a checkpoint a fit started from elsewhere
    is only read.

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
        every_n_steps = _one_of(
            "every_n_steps", every_n_steps, "every_n_train_steps", every_n_train_steps or None
        )
        every_n_minutes = _one_of(
            "every_n_minutes", every_n_minutes, "train_time_interval", _minutes(train_time_interval)
        )
        self.auto_interval = _check_auto(every_n_steps, mtbf_hours)
        if self.auto_interval:
            every_n_steps = None  # decided at the first save of each fit
        flags.check_int("every_n_steps", every_n_steps, 1, allow_none=True)
        flags.check_number("every_n_minutes", every_n_minutes, 0, strict=True, allow_none=True)
        flags.check_int("every_n_epochs", every_n_epochs, 0, allow_none=True)
        if every_n_epochs and (every_n_steps or every_n_minutes):
            raise ValueError(
                f"every_n_epochs={every_n_epochs} with a step or time interval; allowed: one of "
                "every_n_epochs, every_n_train_steps/every_n_steps, train_time_interval/every_n_minutes"
            )
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
        self.auto_insert_metric_name, self.enable_version_counter = (
            auto_insert_metric_name,
            enable_version_counter,
        )
        self.verbose, self.save_weights_only = verbose, save_weights_only
        self.every_n_steps, self.every_n_minutes = every_n_steps, every_n_minutes
        # Lightning's default: with no step or time interval, a monitored metric is saved every epoch
        self.every_n_epochs = (
            every_n_epochs
            if every_n_epochs is not None
            else int(monitor is not None and not every_n_steps and not every_n_minutes)
        )
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.save_last, self.save_top_k = save_last, save_top_k
        self.monitor, self.mode = monitor, mode
        self.validate, self.validate_atol, self.validate_batch = (
            validate,
            float(validate_atol),
            validate_batch,
        )
        self.validate_budget = validate_budget
        # {"path", "step", "score", "good", "pending" (awaits a reload check), "interval_s" (since the
        # previous save), "write_s"} of the checkpoints kept; until validated also "reference" (the live
        # loss, None without one) and "not_finite" (why the live model was not finite, or None)
        self.saved: list[dict[str, Any]] = []
        self.current_score: torch.Tensor | None = None  # the monitored value at the latest save
        self._last_save_time = self._fit_started = time.monotonic()
        self._validation_s: float = 0.0  # seconds spent validating in this fit
        self._last_validation_s: float | None = None  # what the latest validation cost
        self._held_out: tuple[Any] | None = None  # (batch or None), decided at a fit's first save
        self._attempted_step: int | None = None  # the step last saved, good or bad: never saved twice
        self._training = False  # between on_train_start and on_train_end: validations there may save
        self.mtbf_hours = None if mtbf_hours is None else float(mtbf_hours)
        # every_n_steps="auto": what the interval was chosen from (the slowest rank's), set at the first save
        self.save_cost_s: float | None = None
        self.step_time_s: float | None = None
        self.interval_s: float | None = None  # Young/Daly's, in seconds of training
        self.effective_fraction: float | None = None
        self._step_ends: list[float] = []  # monotonic time at the end of each step of this fit, until then

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self.dirpath = self.base_dir(trainer)  # a fit then moves it to the folder it claims (run_folder)
        self._last_save_time = self._fit_started = time.monotonic()
        self._validation_s, self._last_validation_s = 0.0, None
        self._held_out = self._attempted_step = None
        self._training = False
        if self.auto_interval:
            self.every_n_steps, self._step_ends = None, []

    def base_dir(self, trainer: Trainer) -> Path:
        """The folder asked for (`dirpath`, else `<default_root_dir>/checkpoints`): a run's, or its parent."""
        return self._requested or Path(trainer.default_root_dir) / "checkpoints"

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self.saved = trainer.checkpoint_manager.own(self.dirpath)

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._training = True

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
        cost_s = time.monotonic() - start
        # every rank must save at the same steps: the slowest rank's numbers decide for all
        worst = trainer.strategy.reduce(
            torch.tensor([cost_s, step_s], dtype=torch.float64, device=trainer.strategy.root_device),
            "max",
            group="world",
        )
        self.save_cost_s, self.step_time_s = worst.tolist()
        mtbf_s = 3600.0 * self.mtbf_hours
        self.interval_s = young_daly_interval(self.save_cost_s, mtbf_s)
        self.every_n_steps = max(1, round(self.interval_s / max(self.step_time_s, 1e-9)))
        self.effective_fraction = effective_fraction(
            self.save_cost_s, self.every_n_steps * self.step_time_s, mtbf_s
        )
        trainer.log_metrics(
            {
                "checkpoint/every_n_steps": float(self.every_n_steps),
                "checkpoint/effective_fraction": self.effective_fraction,
            }
        )
        rank_zero_info(
            f"ModelCheckpoint: every_n_steps='auto': a save costs {self.save_cost_s:.3g} s and a step "
            f"{self.step_time_s:.3g} s; with mtbf_hours={self.mtbf_hours:g}, Young/Daly's sqrt(2 C MTBF) = "
            f"{self.interval_s:.4g} s: every {self.every_n_steps} steps; projected effective training time "
            f"{100 * self.effective_fraction:.2f}% (1 - C/T - T/(2 MTBF))"
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
        """Whether epoch saves happen at the training epoch's end, else after each validation: Lightning's
        rule (at the epoch's end when validation runs once per epoch at its end, or never)."""
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if trainer.check_val_every_n_epoch != 1:
            return False
        if trainer.val_dataloaders is None or trainer.limit_val_batches == 0:
            return True
        return trainer.val_check_interval in (None, 1.0)

    @property
    def _saves(self) -> bool:
        """Whether a due save writes anything: Lightning's `save_top_k=0` without `save_last` saves nothing."""
        return self.save_top_k != 0 or bool(self.save_last)

    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self.save_last and not self._saved_already(trainer.global_step):
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
            same = [c["path"] for c in self.saved if c["step"] == trainer.global_step]
            return Path(same[-1]) if same else manager.path_for(trainer.global_step, self.dirpath)
        path = self._path_for(trainer, score)
        self._attempted_step = trainer.global_step
        self.current_score = None if score is None else torch.tensor(_plain_score(score))
        manager.finish_writing()  # a background write still running completes first
        self._validate_written(trainer)
        reload = self._validation_due(trainer)
        entry = {"path": str(path), "step": trainer.global_step, "score": score, "good": not reload}
        entry.update(pending=reload, interval_s=time.monotonic() - self._last_save_time)
        if reload:
            start = time.monotonic()
            entry["reference"], entry["not_finite"] = self._live_reference(trainer)
            entry["reference_s"] = time.monotonic() - start  # part of what validation costs
        else:  # not reloaded, but a non-finite model is never kept as good
            entry["not_finite"] = self._not_finite(trainer, self._state_not_finite(trainer))
            if entry["not_finite"] is not None:
                entry.update(good=False, pending=True)
        # listed before writing, so the checkpoint's own copy of this state already knows about itself
        self.saved = [c for c in self.saved if c["path"] != str(path)] + [entry]
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
        entry["write_s"] = time.monotonic() - start
        self._last_save_time = time.monotonic()
        if self.validate and not reload and entry["good"]:
            self._report(
                entry,
                f"reload check skipped: validation has cost {self._validation_s:.2f} s of this fit and the "
                f"last one {self._last_validation_s:.2f} s, over validate_budget={self.validate_budget:g} "
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
    def _top_k(self) -> list[dict[str, Any]]:
        """The good, scored checkpoints Lightning's `best_k_models` holds, best first (ties: the older)."""
        if self.monitor is None or self.save_top_k == 0:
            return []
        ranked = sorted((c for c in self.saved if c["good"] and c["score"] is not None), key=self._rank)
        return ranked if self.save_top_k == -1 else ranked[: self.save_top_k]

    def _rank(self, entry: dict[str, Any]) -> float:
        """Smaller is better; a checkpoint saved without the metric, or with NaN, ranks last."""
        score = entry["score"]
        if score is None or math.isnan(score):
            return math.inf
        return score if self.mode == "min" else -score

    def _newest_good(self) -> dict[str, Any] | None:
        good = [c for c in self.saved if c["good"]]
        return max(good, key=lambda c: c["step"]) if good else None

    @property
    def best_k_models(self) -> dict[str, torch.Tensor]:
        """{path: monitored value} of the top `save_top_k` good checkpoints (empty without `monitor`)."""
        return {c["path"]: torch.tensor(c["score"]) for c in self._top_k()}

    @property
    def best_model_path(self) -> str:
        """The best good checkpoint by `monitor` (without one: the newest), or ""."""
        top = self._top_k()
        newest = self._newest_good() if self.monitor is None else None
        return top[0]["path"] if top else (newest["path"] if newest else "")

    @property
    def best_model_score(self) -> torch.Tensor | None:
        top = self._top_k()
        return torch.tensor(top[0]["score"]) if top else None

    @property
    def kth_best_model_path(self) -> str:
        """The worst of `best_k_models` (the next to go), or ""."""
        top = self._top_k()
        return top[-1]["path"] if top else ""

    @property
    def kth_value(self) -> torch.Tensor:
        top = self._top_k()
        worst = math.inf if self.mode == "min" else -math.inf
        return torch.tensor(top[-1]["score"] if top else worst)

    @property
    def last_model_path(self) -> str:
        """With `save_last`: the newest good checkpoint (its `last` link with "link"), else ""."""
        newest = self._newest_good()
        if not self.save_last or newest is None:
            return ""
        link = Path(self.dirpath) / self.CHECKPOINT_NAME_LAST
        return str(link) if self.save_last == "link" and link.is_symlink() else newest["path"]

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

    def _validation_due(self, trainer: Trainer) -> bool:
        """Whether this checkpoint gets the reload check (rank zero's clock decides): always the first of a
        fit; later ones while validation's time, this one's estimated by the last, stays in the budget."""
        if not self.validate or self.validate_budget is None or self._last_validation_s is None:
            return self.validate
        allowed = FREE_VALIDATION_S + self.validate_budget * (time.monotonic() - self._fit_started)
        due = self._validation_s + self._last_validation_s <= allowed
        return trainer.strategy.any_rank(due and trainer.is_global_zero)

    def _report(self, entry: dict[str, Any], what: str) -> None:
        rank_zero_info(
            f"checkpoint {Path(entry['path']).name}: written in {entry.get('write_s', 0.0):.2f} s "
            f"({_share(entry.get('write_s', 0.0), entry)}); {what}"
        )

    def _saved_already(self, step: int) -> bool:
        """A checkpoint of `step` is kept, or was tried in this fit and failed (it is not written twice)."""
        return self._attempted_step == step or any(c["step"] == step for c in self.saved)

    # ---- validation ------------------------------------------------------------------------------
    def _validate_written(self, trainer: Trainer) -> None:
        """Validate every checkpoint that is completely written and not yet validated, then prune."""
        if not trainer.checkpoint_manager.writing:
            for entry in [c for c in self.saved if not c["good"]]:
                self._validate(trainer, entry)
        self._prune(trainer)

    def _validate(self, trainer: Trainer, entry: dict[str, Any]) -> None:
        path, start = Path(entry["path"]), time.monotonic()
        # a restored entry of a checkpoint that was never validated has neither key: checksums and reload
        not_finite = entry.get("not_finite")
        if not_finite is None:
            problem, loss = self._reload_problem(trainer, path, entry.get("reference"))
        else:  # not reloaded: the live model it was saved from was not finite
            problem, loss = f"is bad: {not_finite}", None
        seconds = time.monotonic() - start + entry.pop("reference_s", 0.0)
        self._validation_s += seconds
        self._last_validation_s = seconds
        if problem is None:
            checked = ["checksums", "reload"] + (["loss"] if loss is not None else [])
            report = {"step": entry["step"], "checked": checked, "loss": loss, "atol": self.validate_atol}
            report.update(seconds=seconds, interval_s=entry.get("interval_s"))
            trainer.checkpoint_manager.mark_validated(path, report)
            entry["good"], entry["pending"] = True, False
            entry.pop("reference", None)
            entry.pop("not_finite", None)
            self._report(
                entry, f"validated ({', '.join(checked)}) in {seconds:.2f} s ({_share(seconds, entry)})"
            )
        else:
            self.saved.remove(entry)
            trainer.checkpoint_manager.mark_bad(path, problem)
        trainer.strategy.barrier(group="world")
        weights = not_finite is not None and self._not_finite(trainer, self._state_not_finite(trainer))
        if (
            weights
        ):  # non-finite weights: training on cannot bring them back; end the fit, naming what is left
            good = [c for c in self.saved if c["good"]]
            last = (
                Path(max(good, key=lambda c: c["step"])["path"]).name if good else "none (no good checkpoint)"
            )
            since = trainer.not_finite_since() or entry["step"]
            raise ModelNotFiniteError(
                f"the model is not finite since step {since}; last good checkpoint: {last}"
            )

    def _reload_problem(
        self, trainer: Trainer, path: Path, reference: float | None
    ) -> tuple[str | None, float | None]:
        """("failed validation (why)", agreed over ranks, or None when good; the reloaded model's loss, None
        when `reference` is None and only the checksums and the reload are checked)."""
        strategy, manager = trainer.strategy, trainer.checkpoint_manager
        problem = manager.verify(path, validated=False)
        if problem is not None:
            return f"failed validation ({problem})", None
        loss = None
        try:
            with manager.trial_load(path):
                if reference is not None:
                    loss = float(trainer.loss_on(self._held_out_batch(trainer)))
        except ckpt.CheckpointError as err:
            problem = f"failed validation ({err})"
        differs = (
            problem is None and reference is not None and not abs(loss - reference) <= self.validate_atol
        )
        if strategy.any_rank(differs or problem is not None):
            reports = strategy.all_gather_object((reference, loss, problem), group="world")
            mismatch = "; ".join(
                f"rank {r}: live {ref!r} vs reloaded {got!r}" for r, (ref, got, _) in enumerate(reports)
            )
            problem = next((p for _, _, p in reports if p), None) or f"failed validation ({mismatch})"
        return problem, loss

    def _live_reference(self, trainer: Trainer) -> tuple[float | None, str | None]:
        """(the live model's loss on the held-out batch, None without one; why the live model is not
        finite, agreed over ranks, or None). Without a loss, every floating tensor of its state is checked."""
        batch = self._held_out_batch(trainer)
        loss = trainer.loss_on(batch) if batch is not None else None
        if batch is not None and loss is None:
            self._compare_no_loss(
                f"{type(trainer.module).__name__}.validation_step returns no loss (return it to have each "
                "reloaded checkpoint's loss compared with the live model's)"
            )
        if loss is None:
            why = self._state_not_finite(trainer)
        else:
            loss = float(loss)
            why = None if math.isfinite(loss) else f"live loss {loss}"
        return loss, self._not_finite(trainer, why)

    @staticmethod
    def _state_not_finite(trainer: Trainer) -> str | None:
        """'<name> has non-finite values' of this rank's first such state-dict tensor, or None."""
        return next(
            (
                f"{name} has non-finite values"
                for name, t in trainer.module.state_dict().items()
                # a module's get_extra_state may put any object in it (saving names it)
                if isinstance(t, torch.Tensor)
                and t.is_floating_point()
                and not bool(torch.isfinite(local_part(t)).all())
            ),
            None,
        )

    @staticmethod
    def _not_finite(trainer: Trainer, why: str | None) -> str | None:
        """Why the live model is not finite (this rank's `why`, or another's), agreed over ranks, or None."""
        strategy = trainer.strategy
        if not strategy.any_rank(why is not None):
            return None
        whys = strategy.all_gather_object(why, group="world")
        rank, why = next((r, w) for r, w in enumerate(whys) if w)
        where = f" on rank {rank}" if len(whys) > 1 else ""
        return f"the model is not finite at step {trainer.global_step} ({why}{where})"

    def _held_out_batch(self, trainer: Trainer) -> Any:
        """The batch whose `validation_step` loss a reload must reproduce, or None: check the checksums and
        the reload only. Decided at a fit's first save, the same on every rank, and said once."""
        if self._held_out is None:
            batch, why = self.validate_batch, None
            if type(trainer.module).validation_step is TrainModule.validation_step:
                batch, why = None, f"{type(trainer.module).__name__} defines no validation_step"
            elif batch is None and trainer.val_dataloaders is None:
                why = "no validation data"
            elif batch is None:
                with isolated_rng():  # drawing a batch must not move the training RNG
                    batch = next(iter(trainer.val_dataloaders), None)
                why = "the validation loader is empty" if batch is None else None
            # a shard can be empty on one rank only; every rank must take the same path (collectives)
            if batch is not None and not trainer.strategy.every_rank(batch is not None):
                batch, why = None, "the validation loader is empty on another rank"
            self._held_out = (batch,)
            if why is not None:
                self._compare_no_loss(why)
        return self._held_out[0]

    def _compare_no_loss(self, why: str) -> None:
        """From now on, validate the checksums and a reload only; say so, with `why`."""
        self._held_out = (None,)
        rank_zero_info(f"checkpoint validation: {why}; checking checksums and a reload only")

    def on_load_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict[str, Any]) -> None:
        """Checkpoints newer than the restored step belong to a discarded future (a resume from an older
        one, a rollback): rename them `discarded-step-...` so that "last" can never go back to them."""
        self.saved = [c for c in self.saved if c["step"] <= trainer.global_step]
        self._attempted_step = None  # the steps after the restored one will be trained (and saved) again
        trainer.checkpoint_manager.discard_newer(trainer.global_step, self.dirpath)

    # ---- retention -------------------------------------------------------------------------------
    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._prune(trainer)  # the strategy has finished any checkpoint still being written

    def _prune(self, trainer: Trainer) -> None:
        """Delete what falls outside the top k, counting only good checkpoints: one still being written
        or validated never pushes a good one out."""
        manager = trainer.checkpoint_manager
        good = [c for c in self.saved if c["good"] and manager.is_complete(c["path"])]
        stale = self._beyond_top_k(good)
        # the manager deletes only checkpoints of this run in this folder (the folder's word, not this list's)
        manager.prune([Path(c["path"]) for c in stale], self.dirpath)
        self.saved = [c for c in self.saved if c not in stale]
        newest = self._newest_good()
        if self.save_last == "link" and newest is not None:
            manager.link_last(Path(self.dirpath) / self.CHECKPOINT_NAME_LAST, Path(newest["path"]))

    def _beyond_top_k(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.save_top_k == -1 or not entries:
            return []
        newest = max(entries, key=lambda c: c["step"])
        if self.monitor:  # a checkpoint saved without the metric (by another saver of the run) ranks last
            ranked = sorted(entries, key=self._rank)
        else:
            ranked = sorted(entries, key=lambda c: -c["step"])
        keep = ranked[: self.save_top_k] + [newest]
        return [c for c in entries if c not in keep]


def _plain_score(score: Any) -> float | None:
    """The monitored value as meta.json holds it."""
    return None if score is None else float(score)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def _one_of(ours: str, value: Any, lightnings: str, alias: Any) -> Any:
    """Our argument or Lightning's name for it; both given and different is a one-line ValueError."""
    if value is not None and alias is not None and value != alias:
        raise ValueError(f"{ours}={value!r} and {lightnings} say different things; allowed: one of them")
    return value if value is not None else alias


def _check_auto(every_n_steps: Any, mtbf_hours: Any) -> bool:
    """Whether the interval is "auto"; a one-line ValueError for a string other than "auto", or for an
    MTBF that is missing, not > 0, or given without "auto"."""
    if isinstance(every_n_steps, str) and every_n_steps != "auto":
        raise ValueError(
            f"every_n_steps={every_n_steps!r} is invalid; allowed: an int >= 1, 'auto' (with mtbf_hours) or None"
        )
    auto = every_n_steps == "auto"
    if auto and mtbf_hours is None:
        raise ValueError(
            "every_n_steps='auto' needs mtbf_hours, the job's mean time between failures; allowed: a number "
            "of hours > 0"
        )
    if mtbf_hours is not None and not auto:
        raise ValueError(
            f"mtbf_hours={mtbf_hours!r} without every_n_steps='auto'; allowed: set every_n_steps='auto' too"
        )
    flags.check_number("mtbf_hours", mtbf_hours, 0, strict=True, allow_none=True)
    return auto


def _minutes(interval: datetime.timedelta | None) -> float | None:
    if interval is None:
        return None
    if not isinstance(interval, datetime.timedelta):
        raise ValueError(
            f"train_time_interval={interval!r} is invalid; allowed: a datetime.timedelta or None"
        )
    return interval.total_seconds() / 60


def _share(seconds: float, entry: dict[str, Any]) -> str:
    """'1.7% of the 300 s since the previous checkpoint' (or since the fit began)."""
    interval = entry.get("interval_s") or 0.0
    pct = 100.0 * seconds / interval if interval > 0 else float("inf")
    return f"{pct:.1f}% of the {interval:.1f} s since the previous checkpoint"
