"""ModelCheckpoint: periodic, atomic checkpoints of the whole training state, keeping the best/newest k."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from trainer.checkpoint import step_dir_name

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class ModelCheckpoint(Callback):
    """Save `<dirpath>/step-XXXXXXXX/` every `every_n_steps` optimizer steps and (with `save_last`) at
    the end of fit. Keeps `save_top_k` checkpoints: the newest ones, or with `monitor` the best by that
    metric (`mode` "min"/"max") plus always the newest, so a resume never goes back. -1 keeps all.
    An older checkpoint is deleted only after the newer one is completely written.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        every_n_steps: int | None = None,
        save_last: bool = True,
        save_top_k: int = 2,
        monitor: str | None = None,
        mode: str = "min",
    ) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps={every_n_steps!r} is invalid; allowed: an int >= 1 or None")
        if not isinstance(save_top_k, int) or save_top_k < -1 or save_top_k == 0:
            raise ValueError(f"save_top_k={save_top_k!r} is invalid; allowed: -1 (keep all) or an int >= 1")
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} is invalid; allowed: 'min' or 'max'")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every_n_steps, self.save_last, self.save_top_k = every_n_steps, save_last, save_top_k
        self.monitor, self.mode = monitor, mode
        self.saved: list[dict[str, Any]] = []  # {"path", "step", "score"} of checkpoints kept
        self.last_path: Path | None = None

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"

    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any]) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self._save(trainer)

    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self.save_last and (
            self.last_path is None or self._step_of(self.last_path) != trainer.global_step
        ):
            self._save(trainer)

    def _save(self, trainer: Trainer) -> None:
        score = trainer.callback_metrics.get(self.monitor) if self.monitor else None
        if self.monitor and score is None:
            raise KeyError(
                f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric; logged: "
                f"{', '.join(sorted(trainer.callback_metrics)) or 'none yet'}"
            )
        path = self.dirpath / step_dir_name(trainer.global_step)
        # listed before writing, so the checkpoint's own copy of this state already knows about itself
        self.saved = [c for c in self.saved if c["path"] != str(path)]
        self.saved.append({"path": str(path), "step": trainer.global_step, "score": score})
        self.last_path = trainer.save_checkpoint(path)
        self._prune(trainer)

    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._prune(trainer)  # the strategy has finished any checkpoint still being written

    def _prune(self, trainer: Trainer) -> None:
        """Delete what falls outside the top k, counting only completed checkpoints: one still being
        written in the background (async save) never pushes a completed one out."""
        complete = [c for c in self.saved if (Path(c["path"]) / "meta.json").exists()]
        stale = self._beyond_top_k(complete)
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

    @staticmethod
    def _step_of(path: Path) -> int:
        return int(Path(path).name.split("-")[-1])

    def state_dict(self) -> dict[str, Any]:
        return {"saved": self.saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = [c for c in state.get("saved", []) if Path(c["path"]).exists()]
