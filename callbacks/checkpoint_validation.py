"""ModelCheckpoint's validation of its checkpoints: which get the reload check within the time budget,
and the check: the live model's loss at save time reproduced by the checkpoint loaded back into it."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from trainer import checkpoint as ckpt
from trainer.checkpoint.records import SavedCheckpoint
from trainer.core.dtensors import local_part
from trainer.core.logging import rank_zero_info
from trainer.core.rng import isolated_rng
from trainer.data.loader import several_loaders
from trainer.module import TrainModule

if TYPE_CHECKING:
    from pathlib import Path

    from trainer.trainer import Trainer

# validation time a fit may always spend: small models validate every checkpoint
FREE_VALIDATION_S = 1.0


class Validation:
    """One fit's checkpoint validation (its clock starts when it is made, at the fit's set-up).

    The ranks verify a checkpoint's hashes (each its share), then every rank loads it into the live module
    (the live values are stashed on the CPU and put back after). When the module overrides
    `validation_step` and there is a held-out batch (`batch`, else the first batch of this rank's
    validation loader), the reloaded model's `validation_step` loss on it must equal the live model's at
    save time within `atol`; otherwise the checksums and the reload only are checked, said once. A model
    not finite at save time (a non-finite live loss; without a loss, a non-finite tensor of its state) is
    not reloaded: its checkpoint fails. `budget`: the first checkpoint of a fit is always checked, a later
    one while validation's total time stays within that share of the fit's time plus FREE_VALIDATION_S
    (None: every one); `validate` False checks none."""

    def __init__(self, validate: bool, budget: float | None, batch: Any = None, atol: float = 0.0) -> None:
        self.validate, self.budget, self.batch, self.atol = validate, budget, batch, atol
        # seconds spent validating in this fit, and what the latest validation cost
        self.spent_s: float = 0.0
        self.last_s: float | None = None
        self._started = time.monotonic()
        # (the held-out batch, or None: checksums and a reload only), decided at the fit's first save
        self._held_out: tuple[Any] | None = None

    def due(self, trainer: Trainer) -> bool:
        """Whether the checkpoint saved now gets the reload check (rank zero's clock decides): always the
        first of a fit; later ones while validation's time, this one's estimated by the last, stays in the
        budget."""
        if not self.validate or self.budget is None or self.last_s is None:
            return self.validate
        allowed = FREE_VALIDATION_S + self.budget * (time.monotonic() - self._started)
        due = self.spent_s + self.last_s <= allowed
        return trainer.strategy.any_rank(due and trainer.is_global_zero)

    def reference(self, trainer: Trainer) -> tuple[float | None, str | None, float]:
        """What the reload check of the checkpoint saved now compares against: (the live model's loss on
        the held-out batch, None without one; why the live model is not finite, agreed over ranks, or None;
        the seconds this took, part of what validation costs). Without a loss, every floating tensor of
        the model's state is checked."""
        start = time.monotonic()
        batch = self.held_out_batch(trainer)
        loss = trainer.loss_on(batch) if batch is not None else None
        if batch is not None and loss is None:
            self._compare_no_loss(
                f"{type(trainer.module).__name__}.validation_step returns no loss (return it to have each "
                "reloaded checkpoint's loss compared with the live model's)"
            )
        if loss is None:
            why = state_not_finite(trainer)
        else:
            loss = float(loss)
            why = None if math.isfinite(loss) else f"live loss {loss}"
        return loss, not_finite(trainer, why), time.monotonic() - start

    def check(self, trainer: Trainer, entry: SavedCheckpoint) -> tuple[str | None, dict[str, Any]]:
        """(why `entry` is bad, agreed over ranks, or None; the report `validated.json` records: what was
        checked, the reloaded loss, the seconds it cost, counted into the budget)."""
        start = time.monotonic()
        if entry.not_finite is None:
            problem, loss = self._reload_problem(trainer, entry.path, entry.reference)
        else:
            # not reloaded: the live model it was saved from was not finite
            problem, loss = f"is bad: {entry.not_finite}", None
        seconds = time.monotonic() - start + entry.reference_s
        self.spent_s += seconds
        self.last_s = seconds
        checked = ["checksums", "reload"] + (["loss"] if loss is not None else [])
        report = {"step": entry.step, "checked": checked, "loss": loss, "atol": self.atol}
        return problem, {**report, "seconds": seconds, "interval_s": entry.interval_s}

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
                    loss = float(trainer.loss_on(self.held_out_batch(trainer)))
        except ckpt.CheckpointError as err:
            problem = f"failed validation ({err})"
        differs = problem is None and reference is not None and not abs(loss - reference) <= self.atol
        if strategy.any_rank(differs or problem is not None):
            reports = strategy.all_gather_object((reference, loss, problem), group="world")
            mismatch = "; ".join(
                f"rank {r}: live {ref!r} vs reloaded {got!r}" for r, (ref, got, _) in enumerate(reports)
            )
            problem = next((p for _, _, p in reports if p), None) or f"failed validation ({mismatch})"
        return problem, loss

    def held_out_batch(self, trainer: Trainer) -> Any:
        """The batch whose `validation_step` loss a reload must reproduce, or None: check the checksums and
        the reload only. Decided at a fit's first save, the same on every rank, and said once."""
        if self._held_out is None:
            batch, why = self.batch, None
            if type(trainer.module).validation_step is TrainModule.validation_step:
                batch, why = None, f"{type(trainer.module).__name__} defines no validation_step"
            elif batch is None and trainer.val_dataloaders is None:
                why = "no validation data"
            elif batch is None:
                # drawing a batch must not move the training RNG
                loaders = trainer.val_dataloaders  # several (Lightning's list): the first one's
                with isolated_rng():
                    batch = next(iter(loaders[0] if several_loaders(loaders) else loaders), None)
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


def state_not_finite(trainer: Trainer) -> str | None:
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


def not_finite(trainer: Trainer, why: str | None) -> str | None:
    """Why the live model is not finite (this rank's `why`, or another's), agreed over ranks, or None."""
    strategy = trainer.strategy
    if not strategy.any_rank(why is not None):
        return None
    whys = strategy.all_gather_object(why, group="world")
    rank, why = next((r, w) for r, w in enumerate(whys) if w)
    where = f" on rank {rank}" if len(whys) > 1 else ""
    return f"the model is not finite at step {trainer.global_step} ({why}{where})"
