"""Lightning's WandbLogger on Weights & Biases, offline unless an API key is configured: without one it
never touches the network and never prompts (sync later with `wandb sync`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only

from trainer.core.logging import rank_zero_info
from trainer.loggers.base import Logger, LoggerRun, NoExperiment

ID_FILE = "wandb_run_id"  # "<run id> <wandb id>": which wandb run a resumed fit continues
GLOBAL_STEP = "trainer/global_step"  # Lightning's x-axis of every metric


class WandbLogger(Logger):
    """`wandb.init(project, name, dir=save_dir, id=version, ...)` at fit start (`**kwargs` go to it).

    The mode: `offline=True`, else `mode` or $WANDB_MODE when set, else "online" with $WANDB_API_KEY or a
    wandb netrc entry, else "offline". `save_dir` None: the Trainer's `default_root_dir` (Lightning's "."
    is its default root). A resumed run continues its wandb run. `log_model` (True or "all") logs the
    run's checkpoint folder as a "model" artifact when the fit ends (Lightning's "all" logs during it)."""

    _SHARED = ("_save_dir", "_id")

    def __init__(
        self,
        name: str | None = None,
        save_dir: str | Path | None = None,
        version: str | None = None,
        offline: bool = False,
        dir: str | Path | None = None,
        id: str | None = None,
        project: str | None = None,
        log_model: bool | str = False,
        prefix: str = "",
        mode: str | None = None,
        **kwargs: Any,
    ) -> None:
        if log_model not in (True, False, "all"):
            raise ValueError(f"WandbLogger log_model={log_model!r} is invalid; allowed: False, True, 'all'")
        if offline and log_model:
            raise ValueError(
                f"WandbLogger(offline=True, log_model={log_model!r}): an offline run uploads no model; "
                "allowed: offline=False (offline anyway without an API key; `wandb sync` uploads it)"
            )
        self._name, self._project = name, project or os.environ.get("WANDB_PROJECT", "lightning_logs")
        given = save_dir if save_dir is not None else dir
        self._save_dir = None if given is None else os.fspath(given)
        self._id = version or id
        self.offline, self.log_model, self.prefix, self.mode = offline, log_model, prefix, mode
        self._kwargs = kwargs
        self._run: Any = None
        self._checkpoint_dir: Path | None = None

    @property
    def name(self) -> str:
        """The project's name, as Lightning's (the run's own name is `experiment.name`)."""
        return self._project

    @property
    def version(self) -> str | None:
        """The wandb run id."""
        return self._run.id if self._run is not None else self._id

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    @property
    def experiment(self) -> Any:
        """The wandb run (`self.logger.experiment.log({...})`); a do-nothing one off rank zero."""
        return self._run if self._run is not None else NoExperiment()

    def setup(self, run: LoggerRun) -> None:
        import wandb

        if self._save_dir is None:
            self._save_dir = os.fspath(run.root_dir)
        mode = "offline" if self.offline else (self.mode or os.environ.get("WANDB_MODE") or None)
        if mode is None:
            mode = "online" if _has_wandb_key() else "offline"
            if mode == "offline":
                rank_zero_info("wandb: no API key found, logging offline; upload later with `wandb sync`")
        id_file = Path(self._save_dir) / ID_FILE
        run_id = self._id or (_resumed_id(id_file, run.run_id) if run.resume_step is not None else None)
        Path(self._save_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self._project,
            name=self._name,
            dir=self._save_dir,
            mode=mode,
            id=run_id,
            resume="allow" if run_id else None,
            **self._kwargs,
        )
        self._id = self._run.id
        # as Lightning's: rows are keyed by trainer/global_step, not wandb's own step, which drops any row
        # logged at a lower step than the last (a validation row after the training rows of its epoch)
        if getattr(self._run, "define_metric", None) is not None:
            self._run.define_metric(GLOBAL_STEP)
            self._run.define_metric("*", step_metric=GLOBAL_STEP, step_sync=True)
        id_file.write_text(f"{run.run_id} {self._run.id}")
        self._checkpoint_dir = run.checkpoint_dir

    @rank_zero_only  # as Lightning's: a call on another rank does nothing
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self._run.config.update(dict(params), allow_val_change=True)

    @rank_zero_only  # as Lightning's: a call on another rank does nothing
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        named = {(f"{self.prefix}-{k}" if self.prefix else k): v for k, v in metrics.items()}
        self._run.log(named if step is None else {**named, GLOBAL_STEP: step})

    def finalize(self, status: str = "success") -> None:
        if self._run is None:
            return
        folder = self._checkpoint_dir
        if self.log_model and folder is not None and folder.is_dir() and any(folder.iterdir()):
            import wandb

            artifact = wandb.Artifact(name=f"model-{self._run.id}", type="model")
            artifact.add_dir(str(folder))
            self._run.log_artifact(artifact, aliases=["latest"])
        self._run.finish(exit_code=0 if status == "success" else 1)
        self._run = None


def _resumed_id(id_file: Path, run_id: str) -> str | None:
    """The wandb id the run `run_id` logged to under this save_dir, if it is the one recorded."""
    try:
        recorded, wandb_id = id_file.read_text().split()
    except (OSError, ValueError):
        return None
    return wandb_id if recorded == run_id else None


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text()
