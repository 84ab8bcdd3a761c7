"""What every logger is: Lightning's `Logger` surface (`log_metrics`, `log_hyperparams`, `name`, `version`,
`save_dir`, `log_dir`, `experiment`, `finalize`) plus `setup`, which the Trainer calls on rank zero when a
fit starts. Loggers open nothing before `setup`, so they can be built in a launcher process and used in a
worker; other ranks learn what rank zero chose (`shared`/`adopt`) and get a do-nothing `experiment`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class FolderLocks(Protocol):
    """The locks that keep a folder to one live fit (trainer/checkpoint/run_folder.py, which the loop passes
    in with the `LoggerRun`, so that loggers import nothing of the checkpoint code)."""

    LOCK_FILE: str
    FolderInUse: type[RuntimeError]

    def acquire(self, folder: Path, run_id: str) -> tuple[Any, str | None]:
        """Take `folder`'s lock: (the lock, with `release()`; a note), or FolderInUse naming the holder."""

    def held_by(self, folder: Path) -> dict[str, Any] | None:
        """The record of the live fit that holds `folder`'s lock, or None."""

    def describe(self, holder: dict[str, Any] | None) -> str:
        """A lock record in words, for a one-line error."""


@dataclass(frozen=True)
class LoggerRun:
    """What a logger learns at fit start: where loggers without a `save_dir` write (the Trainer's
    `default_root_dir`), the fit's run id (a resumed run keeps its own), the restored step (None for a
    fresh run) and the run's checkpoint folder (None without checkpointing)."""

    root_dir: Path
    run_id: str
    resume_step: int | None
    # what a versioned logger locks its folder with (the checkpoint folders' own lock, passed in)
    folder_locks: FolderLocks
    checkpoint_dir: Path | None = None


class Logger:
    """Receives hyperparameters once and metrics per logged step, on rank zero."""

    # what rank zero decides at setup and the other ranks adopt, so that `version`/`log_dir` read the same
    _SHARED: tuple[str, ...] = ()
    # whether it also gets the Trainer's own metrics (train/loss, lr, grad norm, rates, a returned
    # val/loss) next to what the module logs; Lightning's CSV file holds only the latter
    trainer_metrics = True

    def setup(self, run: LoggerRun) -> None:
        """Open files for the fit `run` describes (rank zero)."""

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record the module's hyperparameters (Lightning's meaning: `self.hparams`)."""

    def log_run(self, run: dict[str, Any]) -> None:
        """Record the run's shape and the Trainer's flags (this framework's record; by default not kept)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        raise NotImplementedError

    def save(self) -> None:
        """Put what was logged so far where it stays (a file's buffer on disk), as Lightning's `save`; the
        Trainer calls it before each checkpoint, so a run killed later keeps every row up to it."""

    def finalize(self, status: str = "success") -> None:
        """Flush and close (`status` as Lightning's: "success", "failed", ...)."""

    @property
    def name(self) -> str | None:
        return None

    @property
    def version(self) -> int | str | None:
        return None

    @property
    def save_dir(self) -> str | None:
        return None

    @property
    def log_dir(self) -> str | None:
        return None

    @property
    def experiment(self) -> Any:
        """The backend's object (a SummaryWriter, a wandb run); a do-nothing stand-in where not set up."""
        return NoExperiment()

    def shared(self) -> dict[str, Any]:
        """What rank zero decided at setup, for the other ranks (`adopt`)."""
        return {key: getattr(self, key) for key in self._SHARED}

    def adopt(self, shared: dict[str, Any]) -> None:
        """Take rank zero's decisions (`shared`) on a rank that writes nothing."""
        for key, value in shared.items():
            setattr(self, key, value)


class NoExperiment:
    """Lightning's dummy experiment: any method call (`add_image`, `log`, ...) does nothing, so code that
    writes through `self.logger.experiment` runs on every rank."""

    def __getattr__(self, _: str) -> Any:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> NoExperiment:
        return self

    def __getitem__(self, _: Any) -> NoExperiment:
        return self


def plain(value: Any) -> Any:
    """`value` in types a checkpoint loads with weights_only and a JSON or YAML log can hold; others as
    repr."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)
