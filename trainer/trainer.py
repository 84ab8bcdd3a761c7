"""Trainer: the flags, the entry points (fit / validate / test / predict), read-only views of the run and the
control methods callbacks use. The loop lives in trainer/loop/fit_loop.py and trainer/loop/eval_loop.py, each
process's set-up around it in trainer/loop/stages.py; the strategy owns the parallelism."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from callbacks.base import Callback
from callbacks.batch_size_finder import BatchSizeFinder
from callbacks.checkpoint import ModelCheckpoint
from callbacks.compile_report import CompileReport
from callbacks.lr_finder import LearningRateFinder
from callbacks.progress_bars import check_progress_bars
from strategies.base import Strategy
from strategies.registry import build_strategy
from strategies.techniques.compile_blocks import check_compile
from trainer import flags, lightning_arguments
from trainer.checkpoint.manager import CheckpointManager
from trainer.core.logging import configure_console_logging, rank_zero_info
from trainer.core.metrics import MetricBuffer, UnreadStepValues
from trainer.core.precision import Precision
from trainer.core.rng import seed_everything
from trainer.core.schedules import LRSchedule
from trainer.core.timing import PhaseClock
from trainer.fault_tolerance import FaultTolerance, check_fault_tolerance
from trainer.flag_views import FlagViews
from trainer.loggers import JSONLLogger, Logger, build_logger
from trainer.loop import entry_checks, eval_loop, stages, step_log, trial
from trainer.loop.fit_loop import FitLoop, effective_training_time
from trainer.loop.hooks import HookDispatcher
from trainer.loop.lightning_views import LightningViews
from trainer.loop.manual_step import check_manual_optimization
from trainer.loop.optim_config import SchedulerConfig
from trainer.loop.predict_record import PredictRecord
from trainer.loop.state import LoopState
from trainer.loop.training_state import TrainingState
from trainer.module import TrainModule


class Trainer(LightningViews, FlagViews):
    """Runs a TrainModule's steps: `fit` trains (with validation), `validate`/`test` evaluate.

    Flags mean what they mean in Lightning; `val_at_start` also validates before the first step of a
    fresh run, as the baseline for the val loss that follows. A "step" is an optimizer step; with
    `accumulate_grad_batches=k` it consumes k micro-batches from the loader. `max_steps` and
    `max_epochs` both stop the run, whichever comes first (neither given: one epoch).

    Speed: `compile` (True or a torch.compile mode) compiles each of the model's `transformer_blocks()`
    (or its forward) under one process, DDP and FSDP; `activation_checkpointing` ("full", "selective")
    recomputes each block in the backward (not with DP-SGD); Adam/AdamW/SGD on CUDA use torch's fused kernels unless
    `configure_optimizers` set `fused` or `foreach`.

    `fault_tolerance=FaultTolerance(lighthouse="host:port", replica_id=i, ...)` makes this job one replica
    group of a torchft job: each step forms a quorum of the live groups, averages gradients over them and
    commits or discards; a restarted group rejoins with a live peer's state (trainer/fault_tolerance).
    """

    def __init__(
        self,
        *,
        strategy: str | Strategy = "auto",
        accelerator: str = "auto",
        devices: int | str | list[int] = "auto",
        num_nodes: int = 1,
        max_steps: int | None = None,
        max_epochs: int | None = None,
        min_steps: int | None = None,
        min_epochs: int | None = None,
        val_check_interval: int | float | str | dict | datetime.timedelta | None = None,
        val_at_start: bool = False,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        overfit_batches: int | float = 0.0,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = "norm",
        precision: str | int | None = "32",
        plugins: Any = None,
        compile: bool | str = False,
        activation_checkpointing: str | None = None,
        sync_batchnorm: bool = False,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        seed: int | None = None,
        deterministic: bool | str | None = False,
        benchmark: bool | None = None,
        detect_anomaly: bool = False,
        inference_mode: bool = True,
        use_distributed_sampler: bool = True,
        reload_dataloaders_every_n_epochs: int = 0,
        log_every_n_steps: int | None = None,
        default_root_dir: str | Path | None = "runs",
        callbacks: list[Callback] | Callback | None = None,
        loggers: list[Logger | str] | None = None,
        logger: bool | Logger | str | list[Logger | str] | None = None,
        enable_autolog_hparams: bool = True,
        profiler: Any = None,
        enable_progress_bar: bool | None = None,
        enable_checkpointing: bool | None = None,
        check_val_every_n_epoch: int | None = 1,
        max_time: str | dict | datetime.timedelta | None = None,
        fast_dev_run: bool | int = False,
        barebones: bool = False,
        num_sanity_val_steps: int | None = None,
        enable_model_summary: bool | None = None,
        allow_unverified_checkpoints: bool = False,
        model_registry: str | None = None,
        fault_tolerance: FaultTolerance | None = None,
    ) -> None:
        configure_console_logging()
        given = dict(locals())  # the flags as passed (a copy: some names are rebound below)
        lightning_arguments.resolve_plugins(given)  # precision and sync_batchnorm may come from plugins
        lightning_arguments.apply_barebones(given)
        # the loop flags, checked, as one typed object; `trainer.max_steps`, ... read it (FlagViews)
        self.flags = flags.check_loop_flags(**{name: given[name] for name in flags.LOOP_FLAGS})
        lightning_arguments.say_unapplied(self.model_registry)
        logger, precision = given["logger"], given["precision"]
        self.seed = seed if seed is None else seed_everything(seed)
        if logger is not None:  # Lightning's name; False: no logger but the always-on JSONL file
            if loggers is not None:
                raise ValueError("Trainer got both logger= and loggers=; allowed: one of the two")
            loggers = (
                [] if logger is False or logger is True else logger if isinstance(logger, list) else [logger]
            )
        accelerator = flags.resolve_accelerator(accelerator)
        device_ids = list(devices) if isinstance(devices, (list, tuple)) else None  # Lightning's devices=[i]
        devices = flags.resolve_devices(devices, accelerator)
        num_nodes = flags.check_int("num_nodes", num_nodes, 1)
        self.num_devices, self.num_nodes = devices, num_nodes  # Lightning's: processes per node, nodes
        self.strategy = build_strategy(strategy, processes=devices * num_nodes)
        self.fault_tolerance = check_fault_tolerance(fault_tolerance, self.strategy)
        lightning_arguments.check_distributed_sampler(
            self.use_distributed_sampler, self.strategy, self.fault_tolerance
        )
        self.strategy.set_block_options(activation_checkpointing, check_compile(compile))
        self.strategy.configure(
            accelerator, devices, num_nodes, Precision(precision, accelerator), device_ids
        )
        # Lightning's callbacks= takes one callback as well as a list
        self.callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be Callback instances; got {type(cb).__name__}")
        check_progress_bars(self.callbacks, self.enable_progress_bar)
        # the tuner's callbacks first, as Lightning orders them: the other callbacks' hooks see the lr or batch
        # size they found
        self.callbacks.sort(key=lambda cb: not isinstance(cb, (LearningRateFinder, BatchSizeFinder)))
        if (profiler_callback := lightning_arguments.profiler_callback(profiler)) is not None:
            self.callbacks.append(profiler_callback)
        if self.strategy.compile:
            self.callbacks.append(CompileReport())
        if self.enable_checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in self.callbacks):
            self.callbacks.append(ModelCheckpoint())
        # the user's loggers first (`trainer.logger`, `self.logger` is the first, as in Lightning), then the
        # always-on JSONL log
        self.loggers: list[Logger] = [build_logger(lg) for lg in (loggers or [])]
        if not any(isinstance(lg, JSONLLogger) for lg in self.loggers):
            self.loggers.append(JSONLLogger())

        self.state = LoopState()
        self._dispatch = HookDispatcher(self)
        self._fit_metrics = MetricBuffer()  # what training steps and fit-level hooks log
        self._eval_metrics: MetricBuffer | None = None  # the running evaluation loop's, inside one
        self.predict_loop = PredictRecord()  # Lightning's name: the predict's outputs and batch indices
        # every metric's latest value, for callbacks, and what was logged (`callback_metrics`/`logged_metrics`,
        # which take in the values of steps that wrote no row when read)
        self._callback_metrics: dict[str, float] = {}
        self._logged_metrics: dict[str, float] = {}
        self._unread_steps = UnreadStepValues()
        self.fitting = False  # inside fit (its validations included), as Lightning's state.fn == "fit"
        self.evaluating = False  # inside a validation/test loop
        self.eval_loader_idx: int | None = None  # the evaluation loader running, in a loop over several
        self._step_hooks = False  # from on_train_batch_start to on_train_batch_end of a step
        self.sanity_checking = False  # inside the few validation batches before training (nothing logged)
        self._said_once: set[str] = set()  # the keys of `say_once` lines already said
        self.should_stop = False
        self.resume_hint = "ckpt_path='last'"  # how the user resumes this run (the CLI: its option)
        self.module: TrainModule | None = None
        self.datamodule: Any = None  # the datamodule of the running fit/validate/test/predict
        self._loaders_given = (False, False)  # the fit's (train, val) loaders came as fit()'s arguments
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self._scheduler_config: SchedulerConfig | None = None  # a scheduler from configure_optimizers
        self._schedule: LRSchedule | None = None
        # the running fit's state (the last fit's after it ends, so its views still read); None before
        self._fit_loop: FitLoop | None = None
        self._module_name = ""
        # what a stage's torch switches replaced, put back after it (trainer/loop/torch_switches.py)
        self._torch_switches: Any = None
        # the one owner of the run's checkpoint folders: run id, folders, and every file operation on them
        self.checkpoint_manager = CheckpointManager(self)
        # the training state by named parts: what saves, resumes, rollbacks and replica recovery capture or restore
        self.training_state = TrainingState(self)

    # ---- public read-only views ------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        """The epoch in progress (at its end, through validation and on_train_epoch_end, still that one)."""
        loop = self._fit_loop
        ending = None if loop is None else loop.ending_epoch
        return self.state.epoch if ending is None else ending

    @property
    def step_loss(self) -> torch.Tensor | None:
        """This rank's loss of the optimizer step in progress (a callback may replace it before others read it)."""
        loop = self._fit_loop
        return None if loop is None else loop.step_loss

    @step_loss.setter
    def step_loss(self, loss: torch.Tensor | None) -> None:
        self._fit_loop.step_loss = loss

    @property
    def first_train_batch(self) -> Any:
        """The fit's first micro-batch on this rank, as the loader gave it (None before it is read)."""
        loop = self._fit_loop
        return None if loop is None else loop.first_train_batch

    @property
    def val_dataloaders(self) -> Iterable | None:
        """The fit's validation loader, this rank's shard (None without one)."""
        loop = self._fit_loop
        return None if loop is None else loop.val_loader

    @property
    def logs_this_step(self) -> bool:
        """Whether the optimizer step in progress writes a row (every `log_every_n_steps`, and the last)."""
        step, flags = self.state.global_step + 1, self.flags
        return step % flags.log_every_n_steps == 0 or step == flags.max_steps

    @property
    def in_training_step(self) -> bool:
        """Whether a training step or its batch hooks are running (not a validation inside it): where
        Lightning's `log` defaults to on_step=True, on_epoch=False (elsewhere the reverse)."""
        return self._step_hooks and not self.evaluating

    @property
    def metrics(self) -> MetricBuffer:
        """Where `TrainModule.log` records: the running evaluation loop's buffer inside one, else the fit's."""
        buffer = self._eval_metrics
        return self._fit_metrics if buffer is None else buffer

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def clock(self) -> PhaseClock:
        """Seconds per phase (data/forward/backward/optimizer) of this rank's steps; see trainer.core.timing."""
        return self.strategy.clock

    # ---- entry points ----------------------------------------------------------------------------
    def fit(
        self,
        model: TrainModule,
        train_dataloaders: Iterable | Any = None,
        val_dataloaders: Iterable | None = None,
        datamodule: Any = None,
        ckpt_path: str | Path | None = None,
    ) -> None:
        """Train `model` (Lightning's arguments; a DataModule in place of `train_dataloaders` is taken as the
        `datamodule`); `ckpt_path` "last" resumes from the newest good checkpoint (damaged or never
        validated ones are skipped with a warning; none at all: a fresh start), a path resumes from that
        checkpoint after its checksums are verified. `datamodule` (Lightning's) supplies the loaders."""
        train_dataloaders, datamodule = entry_checks.split_datamodule(train_dataloaders, datamodule, "fit")
        entry_checks.check_fit(model, train_dataloaders, val_dataloaders, ckpt_path, datamodule)
        check_manual_optimization(model, self.flags, self.fault_tolerance)
        self._loaders_given = (train_dataloaders is not None, val_dataloaders is not None)
        self.strategy.check_module(model)
        self.should_stop = False  # as Lightning: a stop asked in an earlier fit does not end this one
        return self.strategy.launch(
            stages.run_fit, self, model, train_dataloaders, val_dataloaders, ckpt_path, datamodule
        )

    def validate(
        self,
        model: TrainModule | None = None,
        dataloaders: Iterable | Any = None,
        ckpt_path: str | Path | None = None,
        *,
        datamodule: Any = None,
    ) -> dict[str, float]:
        """Run `validation_step` over `dataloaders`; returns the metrics (val/loss: the mean over examples and ranks).
        Without `model`, the last fit's (as in Lightning); a DataModule as `dataloaders` is the datamodule."""
        return self._evaluate(model, dataloaders, ckpt_path, "validate", datamodule)

    def test(
        self,
        model: TrainModule | None = None,
        dataloaders: Iterable | Any = None,
        ckpt_path: str | Path | None = None,
        *,
        datamodule: Any = None,
    ) -> dict[str, float]:
        """Run `test_step` over `dataloaders`; returns the metrics (test/loss: the mean over examples and ranks)."""
        return self._evaluate(model, dataloaders, ckpt_path, "test", datamodule)

    def predict(
        self,
        model: TrainModule | None = None,
        dataloaders: Iterable | Any = None,
        ckpt_path: str | Path | None = None,
        *,
        datamodule: Any = None,
    ) -> list[Any]:
        """`predict_step` of every batch of this rank's share of `dataloaders`, in order (rank zero's
        list is returned to a self-spawning script, as Lightning returns each process its own)."""
        return self._evaluate(model, dataloaders, ckpt_path, "predict", datamodule)

    def save_checkpoint(
        self,
        path: str | Path | None = None,
        weights_only: bool = False,
        *,
        pending_validation: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> Path:
        """Write the whole training state (model, optimizer, schedule, loop, RNG, data position,
        callbacks) to the checkpoint directory `path` (default: this run's folder, `step-N`; a file-like name
        such as `example.ckpt` is that directory, said in one line), atomically; a checkpoint of another run
        is never replaced. Call on every rank. `weights_only`: without the optimizer (Lightning's);
        `pending_validation`: "last" will not pick it until `checkpoint.mark_validated` was called; `meta`:
        more fields for its meta.json."""
        if path is not None and not (pending_validation or meta):
            return self.checkpoint_manager.save_as(path, weights_only=weights_only)
        return self.checkpoint_manager.save(
            path, pending_validation=pending_validation, meta=meta, weights_only=weights_only
        )

    def full_state_dict(self, ckpt_path: str | Path = "last") -> dict[str, torch.Tensor]:
        """The full, unsharded model weights (CPU tensors, keyed as the module's `state_dict`) of the
        checkpoint `ckpt_path` names: "last" or "best" of this Trainer's run, or a directory. Any strategy,
        any world size, read in this process without collectives; after fit "last" is the final weights."""
        return self.checkpoint_manager.full_state_dict(ckpt_path)

    # ---- steering: what callbacks may call during a fit ------------------------------------------
    def step_grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the step's gradients (before clipping), computed once per step. Call on every
        rank from on_before_optimizer_step (sharded strategies reduce it over ranks)."""
        return self._fit_loop.step_grad_norm()

    def not_finite_since(self) -> int | None:
        """The first step of this fit whose loss was not finite on any rank, or None. Call on every rank."""
        return self._fit_loop.losses.first_not_finite()

    def skip_optimizer_step(self, reason: str) -> None:
        """Don't apply this step's update (call on every rank, from on_before_optimizer_step): parameters
        and optimizer state stay as they were; the data, the step counter and the LR schedule move on."""
        self._fit_loop.skip_reason = reason

    def rollback(self, before_step: int | None = None) -> Path:
        """Put model, optimizer, RNG streams, LR schedule and step counter back to the newest good checkpoint
        (of a step < `before_step`). The data stream goes on from where it is, so the batches since that
        checkpoint are not replayed (as PaLM does after a loss spike). Call on every rank between steps."""
        return self.checkpoint_manager.rollback(before_step)

    def save_and_stop(self, why: str, *, resumable: bool = True) -> Path:
        """Save a checkpoint of this step (through the run's ModelCheckpoint, validated, when there is one)
        and end the fit after it; `fit(..., ckpt_path="last")` continues from there (unless `resumable` is
        False: a limit that a resume would meet again, such as a spent privacy budget). Call on every rank."""
        path = self._save_for_stop()
        after = (
            f"run the same command with {self.resume_hint} to continue"
            if resumable
            else "this run is complete"
        )
        rank_zero_info(f"stopping at step {self.global_step} ({why}); checkpoint {path}; {after}")
        return path

    def _save_for_stop(self) -> Path:
        """A checkpoint of this step before the fit ends early (through the run's ModelCheckpoint when
        there is one), every rank; the fit then stops."""
        saver = self.checkpoint_callback
        path = saver.save(self) if saver is not None else self.save_checkpoint()
        # min_steps/min_epochs do not hold it back: the checkpoint says the fit stopped here
        self._fit_loop.stop_now()
        return path

    def use_lr_scheduler(self, scheduler: Any, interval: str = "epoch", frequency: int = 1) -> None:
        """Step `scheduler` every `frequency` `interval`s ("step" or "epoch") in place of the fit's LR schedule
        from now on, as Lightning's callbacks replace `trainer.lr_scheduler_configs[0]` (StochasticWeightAveraging's
        SWALR); checkpoints then hold its state."""
        self._scheduler_config = SchedulerConfig(scheduler, interval=interval, frequency=frequency)
        self.lr_scheduler, self._schedule = scheduler, None

    def run_trial(
        self,
        steps: int,
        callbacks: Sequence[Callback] = (),
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        """Up to `steps` optimizer steps of the running fit with only `callbacks` (no validation, loggers or
        checkpoints; `lr_scheduler(optimizer)`, when given, builds the scheduler stepped after each), then
        the model, optimizer, step counters, RNG streams, LR schedule, data position and callbacks' state are
        put back as they were, also when a step failed (as Lightning's tuner restores them from a temporary
        checkpoint). Call on every rank between steps (on_fit_start, on_train_epoch_start)."""
        trial.run_trial(self, steps, callbacks, lr_scheduler)

    def reload_dataloaders(self) -> None:
        """Read the fit's loaders again from its datamodule or module (`train_dataloader()`, and
        `val_dataloader()` unless fit() was given one), e.g. after the batch size finder changed
        `batch_size`; a train loader passed to fit() cannot be: a one-line error. Call on every rank."""
        trial.reload_fit_loaders(self)

    def log_metrics(self, metrics: dict[str, float], hidden: set[str] = frozenset()) -> None:
        """Send metrics (already agreed over ranks) to every logger at the current step, except the
        `hidden` names (logged with logger=False); rank zero writes. All of them reach `callback_metrics`,
        a `name_step`/`name_epoch` pair also under `name` (its latest value), as in Lightning."""
        step_log.log_metrics(self, metrics, hidden)

    def loss_on(self, batch: Any) -> torch.Tensor | None:
        """This rank's `validation_step` loss on `batch` in eval mode, without gradients, RNG or metric side
        effects; None when the step returns nothing (it only logs). Never `training_step`: it may count,
        log or change state. Call on every rank (sharded models gather)."""
        return eval_loop.loss_on(self, batch)

    def effective_training_time(self) -> dict[str, float]:
        """Productive step seconds over wall-clock seconds since the run first started (restarts,
        checkpoint and validation stalls, skipped and rolled-back steps are not productive)."""
        return effective_training_time(self.state)

    def _reduce_logged(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """`sync_dist`: over the ranks that hold different data (and sequence shards)."""
        return self.strategy.reduce(tensor, op, group="loss")

    def _evaluate(
        self, module: TrainModule | None, loader: Any, ckpt_path: Any, stage: str, datamodule: Any
    ) -> Any:
        if module is None:  # Lightning's: the module of the last fit
            if self.module is None:
                raise TypeError(f"{stage} got no model and this Trainer ran no fit; allowed: a TrainModule")
            module = self.module
        loader, datamodule = entry_checks.split_datamodule(loader, datamodule, stage)
        entry_checks.check_evaluate(module, loader, ckpt_path, stage, datamodule)
        self.strategy.check_module(module)
        return self.strategy.launch(stages.run_evaluate, self, module, loader, ckpt_path, stage, datamodule)

    # ---- checkpoints -----------------------------------------------------------------------------
    @property
    def run_id(self) -> str | None:
        """This fit's run id (a resumed run's own), written into each checkpoint; None before any."""
        return self.checkpoint_manager.run_id

    @property
    def checkpoint_dir(self) -> Path:
        """This run's checkpoint folder: the one this fit claimed (trainer/checkpoint/run_folder.py), else the newest
        run's under the ModelCheckpoint's dirpath or `<default_root_dir>/checkpoints` (what "last" reads)."""
        return self.checkpoint_manager.folder

    # ---- small helpers ---------------------------------------------------------------------------
    def call_callbacks(self, hook: str, *args: Any) -> None:
        """Every callback's `hook` (callbacks that define hooks of their own fire them through this)."""
        self._dispatch.callbacks(hook, *args)

    def say_once(self, key: str, message: str) -> None:
        """Rank zero's info line `message`, the first time this Trainer is asked with `key`."""
        if key not in self._said_once:
            self._said_once.add(key)
            rank_zero_info(message)
