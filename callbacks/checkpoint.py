"""ModelCheckpoint: periodic, atomic, validated checkpoints of the whole training state, keeping the best/newest k."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from trainer import checkpoint as ckpt
from trainer import flags
from trainer.logging import log
from trainer.rng import isolated_rng

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class ModelCheckpoint(Callback):
    """Save `<dirpath>/step-XXXXXXXX/` every `every_n_steps` optimizer steps and/or `every_n_minutes`, and
    (with `save_last`) at the end of fit. Each file's SHA-256 goes into the checkpoint's manifest.

    With `validate`, a checkpoint is *good* only after it was proven loadable: the checksums are verified,
    the checkpoint is loaded into the live module (same processes, sharded the same way; the live values
    are stashed on the CPU and put back after), and its loss on a held-out batch must equal the loss the
    live model had at save time within `validate_atol` (0.0: bitwise). A checkpoint that fails is renamed
    `bad-step-...` and the older good ones stay. `ckpt_path="last"` only ever resumes from good ones.
    The held-out batch is `validate_batch`, else the first batch of the validation loader, else the
    fit's first training micro-batch. With an async-saving strategy, validation happens once the
    background write finished (at the next save or the end of fit).

    Keeps `save_top_k` good checkpoints: the newest ones, or with `monitor` the best by that metric
    (`mode` "min"/"max") plus always the newest. -1 keeps all. Nothing is deleted before a newer
    checkpoint is good.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = None,
        save_last: bool = True,
        save_top_k: int = 2,
        monitor: str | None = None,
        mode: str = "min",
        validate: bool = True,
        validate_atol: float = 0.0,
        validate_batch: Any = None,
    ) -> None:
        flags.check_int("every_n_steps", every_n_steps, 1, allow_none=True)
        flags.check_number("every_n_minutes", every_n_minutes, 0, strict=True, allow_none=True)
        if (
            isinstance(save_top_k, bool)
            or not isinstance(save_top_k, int)
            or save_top_k < -1
            or save_top_k == 0
        ):
            raise ValueError(f"save_top_k={save_top_k!r} is invalid; allowed: -1 (keep all) or an int >= 1")
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} is invalid; allowed: 'min' or 'max'")
        flags.check_number("validate_atol", validate_atol, 0)
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every_n_steps, self.every_n_minutes = every_n_steps, every_n_minutes
        self.save_last, self.save_top_k = save_last, save_top_k
        self.monitor, self.mode = monitor, mode
        self.validate, self.validate_atol, self.validate_batch = (
            validate,
            float(validate_atol),
            validate_batch,
        )
        # {"path", "step", "score", "good"} of the checkpoints kept; "reference" (live loss) until validated
        self.saved: list[dict[str, Any]] = []
        self._last_save_time = time.monotonic()

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"
        self._last_save_time = time.monotonic()

    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any]) -> None:
        due = bool(self.every_n_steps) and trainer.global_step % self.every_n_steps == 0
        if self.every_n_minutes is not None:
            late = time.monotonic() - self._last_save_time >= 60 * self.every_n_minutes
            # clocks differ per rank: rank zero's decides (every rank must save at the same step)
            due |= bool(trainer.strategy.reduce(torch.tensor(float(late and trainer.is_global_zero)), "max"))
        if due:
            self.save(trainer)

    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self.save_last and not any(c["step"] == trainer.global_step for c in self.saved):
            self.save(trainer)
        trainer.strategy.finish_checkpoint()
        self._validate_written(trainer)

    def save(self, trainer: Trainer) -> Path:
        """Save a checkpoint of the current step now (on every rank), validate it, then prune."""
        score = trainer.callback_metrics.get(self.monitor) if self.monitor else None
        if self.monitor and score is None:
            raise KeyError(
                f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric; logged: "
                f"{', '.join(sorted(trainer.callback_metrics)) or 'none yet'}"
            )
        path = self.dirpath / ckpt.step_dir_name(trainer.global_step)
        if any(c["step"] == trainer.global_step for c in self.saved):
            return path  # saved already (say, by a Timer and by the schedule at the same step)
        trainer.strategy.finish_checkpoint()  # a background write still running completes first
        self._validate_written(trainer)
        entry = {"path": str(path), "step": trainer.global_step, "score": score, "good": not self.validate}
        if self.validate:
            entry["reference"] = float(trainer.loss_on(self._held_out_batch(trainer)))
        # listed before writing, so the checkpoint's own copy of this state already knows about itself
        self.saved = [c for c in self.saved if c["path"] != str(path)] + [entry]
        trainer.save_checkpoint(path, pending_validation=self.validate)
        self._last_save_time = time.monotonic()
        self._validate_written(trainer)
        return path

    # ---- validation ------------------------------------------------------------------------------
    def _validate_written(self, trainer: Trainer) -> None:
        """Validate every checkpoint that is completely written and not yet validated, then prune."""
        if not trainer.strategy.checkpoint_in_progress:
            for entry in [c for c in self.saved if not c["good"]]:
                self._validate(trainer, entry)
        self._prune(trainer)

    def _validate(self, trainer: Trainer, entry: dict[str, Any]) -> None:
        path, strategy = Path(entry["path"]), trainer.strategy
        problem = None
        if trainer.is_global_zero:
            try:
                ckpt.verify(path)
            except (ckpt.CheckpointError, FileNotFoundError) as err:
                problem = str(err)
        problem = strategy.broadcast_object(problem)
        loss = float("nan")
        if problem is None:
            stash = _stash(trainer.module)
            try:
                strategy.load_checkpoint(path, trainer.module, None)
                loss = float(trainer.loss_on(self._held_out_batch(trainer)))
            except ckpt.CheckpointError as err:
                problem = str(err)
            finally:
                _unstash(stash)
                strategy.reshard(trainer.module)
            differs = not abs(loss - entry["reference"]) <= self.validate_atol
            if bool(strategy.reduce(torch.tensor(float(differs or problem is not None)), "max")):
                pairs = strategy.all_gather_object((entry["reference"], loss, problem))
                problem = next((p for _, _, p in pairs if p), None) or "; ".join(
                    f"rank {r}: live {ref!r} vs reloaded {got!r}" for r, (ref, got, _) in enumerate(pairs)
                )
        if problem is None:
            if trainer.is_global_zero:
                ckpt.mark_validated(path, {"step": entry["step"], "loss": loss, "atol": self.validate_atol})
            entry["good"] = True
            entry.pop("reference")
        else:
            self.saved.remove(entry)
            if trainer.is_global_zero:
                bad = ckpt.mark_bad(path) if path.exists() else path
                log.error(
                    f"checkpoint {path.name} failed validation ({problem}); moved to {bad.name}, "
                    "the older good checkpoints are kept"
                )
        strategy.barrier()

    def _held_out_batch(self, trainer: Trainer) -> Any:
        if self.validate_batch is None:
            if trainer.val_dataloaders is not None:
                with isolated_rng():
                    self.validate_batch = next(iter(trainer.val_dataloaders))
            else:
                self.validate_batch = trainer.first_train_batch
        return self.validate_batch

    def on_load_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict[str, Any]) -> None:
        """Checkpoints newer than the restored step belong to a discarded future (a resume from an older
        one, a rollback): rename them `discarded-step-...` so that "last" can never go back to them."""
        self.saved = [c for c in self.saved if c["step"] <= trainer.global_step]
        if trainer.is_global_zero:
            for path in ckpt.newer_than(self.dirpath, trainer.global_step):
                target = path.with_name(f"discarded-{path.name}")
                shutil.rmtree(target, ignore_errors=True)
                path.rename(target)
                log.warning(
                    f"{path.name} is newer than the restored step {trainer.global_step}: moved to {target.name}"
                )

    # ---- retention -------------------------------------------------------------------------------
    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._prune(trainer)  # the strategy has finished any checkpoint still being written

    def _prune(self, trainer: Trainer) -> None:
        """Delete what falls outside the top k, counting only good checkpoints: one still being written
        or validated never pushes a good one out."""
        good = [c for c in self.saved if c["good"] and (Path(c["path"]) / ckpt.META_FILE).exists()]
        stale = self._beyond_top_k(good)
        if trainer.is_global_zero:
            for entry in stale:
                shutil.rmtree(entry["path"], ignore_errors=True)
        self.saved = [c for c in self.saved if c not in stale]

    def _beyond_top_k(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.save_top_k == -1 or not entries:
            return []
        newest = max(entries, key=lambda c: c["step"])
        if self.monitor:
            sign = 1.0 if self.mode == "min" else -1.0
            ranked = sorted(entries, key=lambda c: sign * c["score"])
        else:
            ranked = sorted(entries, key=lambda c: -c["step"])
        keep = ranked[: self.save_top_k] + [newest]
        return [c for c in entries if c not in keep]

    def state_dict(self) -> dict[str, Any]:
        return {"saved": [{k: v for k, v in c.items() if k != "reference"} for c in self.saved]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = []
        for c in state.get("saved", []):
            path = Path(c["path"])
            if path.exists():  # a checkpoint's own entry was written before it was validated
                good = (path / ckpt.VALIDATED_FILE).exists() or not self.validate
                self.saved.append({**c, "good": good})


def _stash(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CPU copies of this rank's part of every state-dict tensor, to put back after a trial load."""
    local = [_local(t) for t in module.state_dict().values()]
    return [(t, t.detach().to("cpu", copy=True)) for t in local]


def _unstash(stash: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for target, saved in stash:
            target.copy_(saved)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
