"""Trainer: fit / validate / test. It owns the loop and nothing else; the strategy owns the parallelism."""

from __future__ import annotations

import datetime
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from callbacks.base import Callback
from callbacks.checkpoint import ModelCheckpoint
from callbacks.compile_report import CompileReport
from strategies.base import Strategy
from strategies.compile_blocks import check_compile
from strategies.registry import build_strategy
from trainer import eval_loop, flags, step_log
from trainer.checkpoint_manager import CheckpointManager
from trainer.data.loader import pin_for_device
from trainer.datamodule import call_if_defined, check_source, has_loader, loaders_from
from trainer.fit_loop import FitLoop, effective_training_time
from trainer.hooks import HookDispatcher
from trainer.logging import (
    JSONLLogger,
    Logger,
    build_logger,
    configure_console_logging,
    rank_zero_info,
    set_rank,
)
from trainer.metrics import MetricBuffer
from trainer.module import TrainModule, uncalled_lightning_methods
from trainer.optim_config import SchedulerConfig
from trainer.precision import Precision
from trainer.rng import seed_everything
from trainer.schedules import SCHEDULES, LRSchedule
from trainer.state import LoopState
from trainer.timing import PhaseClock


class Trainer:
    """Runs a TrainModule's steps: `fit` trains (with validation), `validate`/`test` evaluate.

    Flags mean what they mean in Lightning; `val_at_start` also validates before the first step of a
    fresh run, as the baseline for the val loss that follows. A "step" is an optimizer step; with
    `accumulate_grad_batches=k` it consumes k micro-batches from the loader. `max_steps` and
    `max_epochs` both stop the run, whichever comes first (neither given: one epoch).

    Speed: `compile` (True or a torch.compile mode) compiles each of the model's `transformer_blocks()`
    (or its forward) under one process, DDP and FSDP; `activation_checkpointing` ("full", "selective")
    recomputes each block in the backward (not with DP-SGD); Adam/AdamW/SGD on CUDA use torch's fused kernels unless
    `configure_optimizers` set `fused` or `foreach`.
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
        val_check_interval: int | float | None = None,
        val_at_start: bool = False,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        precision: str | int = "32",
        compile: bool | str = False,
        activation_checkpointing: str | None = None,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        seed: int | None = None,
        deterministic: bool = False,
        log_every_n_steps: int = 10,
        default_root_dir: str | Path = "runs",
        callbacks: list[Callback] | None = None,
        loggers: list[Logger | str] | None = None,
        logger: bool | Logger | str | list[Logger | str] | None = None,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        check_val_every_n_epoch: int = 1,
        max_time: str | dict | datetime.timedelta | None = None,
        fast_dev_run: bool | int = False,
        num_sanity_val_steps: int = 2,
        enable_model_summary: bool = True,
        allow_unverified_checkpoints: bool = False,
    ) -> None:
        configure_console_logging()
        if fast_dev_run:  # Lightning's smoke run: n batches of each loop (True: 1), no checkpoints
            n = flags.check_int("fast_dev_run", 1 if fast_dev_run is True else fast_dev_run, 1)
            max_steps, max_epochs, val_check_interval, enable_checkpointing = n, 1, None, False
            num_sanity_val_steps = 0
            limit_train_batches = limit_val_batches = limit_test_batches = limit_predict_batches = n
            log_every_n_steps = 1
        if logger is not None:  # Lightning's name; False: no logger but the always-on JSONL file
            if loggers is not None:
                raise ValueError("Trainer got both logger= and loggers=; allowed: one of the two")
            loggers = (
                [] if logger is False or logger is True else logger if isinstance(logger, list) else [logger]
            )
        accelerator = flags.resolve_accelerator(accelerator)
        self.max_steps = flags.check_int("max_steps", max_steps, 1, allow_none=True)
        self.max_epochs = flags.check_int("max_epochs", max_epochs, 1, allow_none=True)
        if self.max_steps is None and self.max_epochs is None:
            self.max_epochs = 1
        self.val_check_interval = flags.check_val_interval(val_check_interval)
        self.val_at_start = bool(val_at_start)
        self.num_sanity_val_steps = flags.check_int("num_sanity_val_steps", num_sanity_val_steps, -1)
        self.enable_model_summary = bool(enable_model_summary)
        self.check_val_every_n_epoch = flags.check_int("check_val_every_n_epoch", check_val_every_n_epoch, 1)
        self.max_time = flags.check_max_time(max_time)
        self.limit_train_batches = flags.check_limit("limit_train_batches", limit_train_batches)
        self.limit_val_batches = flags.check_limit("limit_val_batches", limit_val_batches)
        self.limit_test_batches = flags.check_limit("limit_test_batches", limit_test_batches)
        self.limit_predict_batches = flags.check_limit("limit_predict_batches", limit_predict_batches)
        self.accumulate_grad_batches = flags.check_int("accumulate_grad_batches", accumulate_grad_batches, 1)
        self.gradient_clip_val = flags.check_clip(gradient_clip_val)
        self.gradient_clip_algorithm = flags.check_choice(
            "gradient_clip_algorithm", gradient_clip_algorithm, ("norm", "value")
        )
        self.lr_schedule = flags.check_choice("lr_schedule", lr_schedule, SCHEDULES)
        self.warmup_steps = flags.check_int("warmup_steps", warmup_steps, 0)
        if (
            isinstance(min_lr_ratio, bool)
            or not isinstance(min_lr_ratio, (int, float))
            or not 0 <= min_lr_ratio <= 1
        ):
            raise ValueError(f"min_lr_ratio={min_lr_ratio!r} is invalid; allowed: a number in [0, 1]")
        self.min_lr_ratio = float(min_lr_ratio)
        if self.max_steps is not None:  # checked now, before any process starts
            LRSchedule(self.lr_schedule, self.warmup_steps, self.max_steps, self.min_lr_ratio)
        self.seed = seed if seed is None else seed_everything(seed)
        self.deterministic = bool(deterministic)
        self.log_every_n_steps = flags.check_int("log_every_n_steps", log_every_n_steps, 1)
        self.default_root_dir = Path(default_root_dir)
        self.enable_progress_bar = bool(enable_progress_bar)
        # a checkpoint without a manifest (or an empty one) loads only when asked, with a warning
        self.allow_unverified_checkpoints = bool(allow_unverified_checkpoints)

        device_ids = list(devices) if isinstance(devices, (list, tuple)) else None  # Lightning's devices=[i]
        devices = flags.resolve_devices(devices, accelerator)
        num_nodes = flags.check_int("num_nodes", num_nodes, 1)
        self.strategy = build_strategy(strategy, processes=devices * num_nodes)
        self.strategy.set_block_options(activation_checkpointing, check_compile(compile))
        self.strategy.configure(
            accelerator, devices, num_nodes, Precision(precision, accelerator), device_ids
        )
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be Callback instances; got {type(cb).__name__}")
        if self.strategy.compile:
            self.callbacks.append(CompileReport())
        if enable_checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in self.callbacks):
            self.callbacks.append(ModelCheckpoint())
        self.loggers = [build_logger(lg) for lg in (loggers or [])]
        if not any(isinstance(lg, JSONLLogger) for lg in self.loggers):
            self.loggers.insert(0, JSONLLogger())

        self.state = LoopState()
        self._dispatch = HookDispatcher(self)
        self._fit_metrics = MetricBuffer()  # what training steps and fit-level hooks log
        self._eval_metrics: MetricBuffer | None = None  # the running evaluation loop's, inside one
        self.callback_metrics: dict[str, float] = {}  # every metric's latest value, for callbacks
        self.logged_metrics: dict[str, float] = {}  # what was sent to the loggers
        self.evaluating = False  # inside a validation/test loop
        self._step_hooks = False  # from on_train_batch_start to on_train_batch_end of a step
        self.sanity_checking = False  # inside the few validation batches before training (nothing logged)
        self._warned_none_step = False
        self.should_stop = False
        self.module: TrainModule | None = None
        self.datamodule: Any = None  # the datamodule of the running fit/validate/test/predict
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self._scheduler_config: SchedulerConfig | None = None  # a scheduler from configure_optimizers
        self._schedule: LRSchedule | None = None
        # the running fit's state (the last fit's after it ends, so its views still read); None before
        self._fit_loop: FitLoop | None = None
        self._module_name = ""
        self._was_deterministic = False
        # the one owner of the run's checkpoint folders: run id, folders, and every file operation on them
        self.checkpoint_manager = CheckpointManager(self)

    # ---- public read-only views ------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        """The epoch in progress (at its end, through validation and on_train_epoch_end, still that one)."""
        loop = self._fit_loop
        return self.state.epoch - (loop is not None and loop.epoch_ending)

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
        step = self.state.global_step + 1
        return step % self.log_every_n_steps == 0 or step == self.max_steps

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
        """Seconds per phase (data/forward/backward/optimizer) of this rank's steps; see trainer.timing."""
        return self.strategy.clock

    # ---- entry points ----------------------------------------------------------------------------
    def fit(
        self,
        module: TrainModule,
        train_dataloaders: Iterable | None = None,
        val_dataloaders: Iterable | None = None,
        ckpt_path: str | Path | None = None,
        *,
        datamodule: Any = None,
    ) -> None:
        """Train `module`; `ckpt_path` "last" resumes from the newest good checkpoint (damaged or never
        validated ones are skipped with a warning; none at all: a fresh start), a path resumes from that
        checkpoint after its checksums are verified. `datamodule` (Lightning's) supplies the loaders."""
        _check_module(module)
        given = train_dataloaders if val_dataloaders is None else val_dataloaders
        source = _loader_source(module, "fit", datamodule, given, own=train_dataloaders is None)
        if source is None:
            if train_dataloaders is None:
                raise ValueError("fit needs train_dataloaders; got None")
            _check_not_empty("train_dataloaders", train_dataloaders)
            if val_dataloaders is not None:
                _check_not_empty("val_dataloaders", val_dataloaders)
        _check_ckpt_path(ckpt_path)
        self.strategy.check_module(module)
        return self.strategy.launch(
            self._run_fit, module, train_dataloaders, val_dataloaders, ckpt_path, datamodule
        )

    def validate(
        self,
        module: TrainModule,
        dataloaders: Iterable | None = None,
        ckpt_path: str | Path | None = None,
        *,
        datamodule: Any = None,
    ) -> dict[str, float]:
        """Run `validation_step` over `dataloaders`; returns the metrics (means over batches and ranks)."""
        return self._evaluate(module, dataloaders, ckpt_path, "validate", datamodule)

    def test(
        self,
        module: TrainModule,
        dataloaders: Iterable | None = None,
        ckpt_path: str | Path | None = None,
        *,
        datamodule: Any = None,
    ) -> dict[str, float]:
        """Run `test_step` over `dataloaders`; returns the metrics (means over batches and ranks)."""
        return self._evaluate(module, dataloaders, ckpt_path, "test", datamodule)

    def predict(
        self,
        module: TrainModule,
        dataloaders: Iterable | None = None,
        ckpt_path: str | Path | None = None,
        *,
        datamodule: Any = None,
    ) -> list[Any]:
        """`predict_step` of every batch of this rank's share of `dataloaders`, in order (rank zero's
        list is returned to a self-spawning script, as Lightning returns each process its own)."""
        return self._evaluate(module, dataloaders, ckpt_path, "predict", datamodule)

    def save_checkpoint(
        self,
        path: str | Path | None = None,
        *,
        pending_validation: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> Path:
        """Write the whole training state (model, optimizer, schedule, loop, RNG, data position,
        callbacks) to `path` (default: this run's folder, `step-N`), atomically; a checkpoint of another run
        is never replaced. Call on every rank. `pending_validation`: "last" will not pick it until
        `checkpoint.mark_validated` was called; `meta`: more fields for its meta.json."""
        return self.checkpoint_manager.save(path, pending_validation=pending_validation, meta=meta)

    # ---- steering: what callbacks may call during a fit ------------------------------------------
    def step_grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the step's gradients (before clipping), computed once per step. Call on every
        rank from on_before_optimizer_step (sharded strategies reduce it over ranks)."""
        return self._fit_loop.step_grad_norm()

    def not_finite_since(self) -> int | None:
        """The first step of this fit whose loss was not finite on any rank, or None. Call on every rank."""
        return self._fit_loop.not_finite_since()

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
        saver = self.checkpoint_callback
        path = saver.save(self) if saver is not None else self.save_checkpoint()
        self.should_stop = True
        after = (
            "run the same command with ckpt_path='last' to continue" if resumable else "this run is complete"
        )
        rank_zero_info(f"stopping at step {self.global_step} ({why}); checkpoint {path}; {after}")
        return path

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

    # ---- fit -------------------------------------------------------------------------------------
    def _run_fit(
        self,
        module: TrainModule,
        train_loader: Iterable | None,
        val_loader: Iterable | None,
        ckpt_path: Any,
        datamodule: Any,
    ) -> None:
        self._setup(module, "fit", datamodule)
        try:
            if train_loader is None:  # the datamodule's, or the module's own, read after their setup
                train_loader, own_val = loaders_from(datamodule or module, "fit")
                val_loader = own_val if val_loader is None else val_loader
                _check_not_empty("train_dataloader()", train_loader)
                if val_loader is not None:
                    _check_not_empty("val_dataloader()", val_loader)
            train_loader = self._loader(train_loader, train=True)
            val_loader = self._loader(val_loader, train=False) if val_loader is not None else None
            self._fit_loop = FitLoop(self, module, train_loader, val_loader)
            self._fit_loop.run(ckpt_path)
        except BaseException as exc:
            self._dispatch.callbacks("on_exception", exc)
            raise
        finally:
            self._finish("fit")

    def _reduce_logged(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """`sync_dist`: over the ranks that hold different data (and sequence shards)."""
        return self.strategy.reduce(tensor, op, group="loss")

    # ---- evaluation ------------------------------------------------------------------------------
    def _evaluate(
        self, module: TrainModule, loader: Iterable | None, ckpt_path: Any, stage: str, datamodule: Any
    ) -> Any:
        _check_module(module)
        source = _loader_source(module, stage, datamodule, loader, own=loader is None)
        if source is None:
            if loader is None:
                raise ValueError(f"{stage} needs dataloaders or a datamodule; got neither")
            _check_not_empty("dataloaders", loader)
        _check_ckpt_path(ckpt_path)
        self.strategy.check_module(module)
        return self.strategy.launch(self._run_evaluate, module, loader, ckpt_path, stage, datamodule)

    def _run_evaluate(
        self, module: TrainModule, loader: Iterable | None, ckpt_path: Any, stage: str, datamodule: Any
    ) -> dict[str, float]:
        self._setup(module, stage, datamodule)
        try:
            if loader is None:
                loader, _ = loaders_from(datamodule or module, stage)
                _check_not_empty(f"{stage} dataloader", loader)
            loader = self._loader(loader, train=False)
            self.checkpoint_manager.load_model(ckpt_path)
            if stage == "predict":
                return eval_loop.evaluate(self, module, loader, "predict", self.limit_predict_batches)[2]
            loop = "validation" if stage == "validate" else "test"
            limit = self.limit_val_batches if stage == "validate" else self.limit_test_batches
            metrics, _, _ = eval_loop.evaluate(self, module, loader, loop, limit)
            if self.is_global_zero and self.enable_progress_bar:
                print("  ".join(f"{k} {v:.4f}" for k, v in metrics.items()), file=sys.stderr)
            return metrics
        finally:
            self._finish(stage)

    # ---- set-up and tear-down --------------------------------------------------------------------
    def _setup(self, module: TrainModule, stage: str, datamodule: Any) -> None:
        strategy = self.strategy
        strategy.setup_environment()
        set_rank(strategy.global_rank)
        self.datamodule = datamodule
        self._prepare_data(module, datamodule)
        call_if_defined(datamodule, "setup", stage)
        if self.seed is not None:
            seed_everything(self.seed)
        self._was_deterministic = torch.are_deterministic_algorithms_enabled()
        if self.deterministic:
            torch.use_deterministic_algorithms(True)  # for this run only: _finish restores the setting
        module._trainer = self
        self.module = module
        self._module_name = type(module).__name__  # before wrapping (FSDP2 renames the class)
        uncalled = uncalled_lightning_methods(module)
        if uncalled and type(module) not in _WARNED_UNCALLED:
            _WARNED_UNCALLED.add(type(module))
            rank_zero_info(
                f"warning: {type(module).__name__} defines Lightning hook(s) this Trainer never calls: "
                f"{', '.join(uncalled)} (see README, 'Coming from Lightning')"
            )
        self._dispatch.callbacks("setup", stage)
        module.setup(stage)
        with strategy.module_init_context():
            module.configure_model()
        if not any(True for _ in module.parameters()):
            raise ValueError(
                f"{type(module).__name__} has no parameters; build layers in __init__ or configure_model()"
            )
        strategy.setup_module(module)

    def _prepare_data(self, module: TrainModule, datamodule: Any) -> None:
        """Lightning's `prepare_data`: once per node (local rank 0; global rank 0 when the owner sets
        `prepare_data_per_node = False`) while the other processes wait, so none reads a half-written file."""
        for owner in (datamodule, module):
            if owner is None or not callable(getattr(owner, "prepare_data", None)):
                continue
            per_node = getattr(owner, "prepare_data_per_node", True)
            if (self.strategy.local_rank if per_node else self.strategy.global_rank) == 0:
                owner.prepare_data()
        self.strategy.barrier()

    def _finish(self, stage: str) -> None:
        loop = self._fit_loop
        if loop is not None and loop.progress is not None:
            loop.progress.close()
            loop.progress = None
        self.strategy.teardown()  # first: it completes checkpoints still being written
        self.checkpoint_manager.release()  # then this fit's folders are free for the next one
        self._dispatch.callbacks("teardown", stage)
        self.module.teardown(stage)
        call_if_defined(self.datamodule, "teardown", stage)
        if self.is_global_zero and stage == "fit":  # last: callbacks may still log in teardown
            for lg in self.loggers:
                lg.finalize()
        torch.use_deterministic_algorithms(self._was_deterministic)

    # ---- checkpoints -----------------------------------------------------------------------------
    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The run's ModelCheckpoint (callbacks that save, e.g. on a signal, go through it), or None."""
        return self.checkpoint_manager.saver

    @property
    def run_id(self) -> str | None:
        """This fit's run id (a resumed run's own), written into each checkpoint; None before any."""
        return self.checkpoint_manager.run_id

    @property
    def checkpoint_dir(self) -> Path:
        """This run's checkpoint folder: the one this fit claimed (trainer/run_folder.py), else the newest
        run's under the ModelCheckpoint's dirpath or `<default_root_dir>/checkpoints` (what "last" reads)."""
        return self.checkpoint_manager.folder

    # ---- small helpers ---------------------------------------------------------------------------
    def _loader(self, loader: Iterable, train: bool) -> Iterable:
        """The loader this rank reads, as the strategy decides (by default: its share of the batch group);
        ours pins its batches for a GPU, so that their copies there don't wait for the step in flight."""
        loader = self.strategy.process_dataloader(loader, self.seed or 0, train=train)
        pin_for_device(loader, self.strategy.root_device)
        return loader

    def _call(self, hook: str, *args: Any) -> None:
        """Every callback's `hook` (callbacks that define hooks of their own fire them through this)."""
        self._dispatch.callbacks(hook, *args)


def _loader_source(module: TrainModule, stage: str, datamodule: Any, given: Any, own: bool) -> Any:
    """What supplies `stage`'s loaders inside each process: the datamodule (checked now, before any
    process starts), the module's own `*_dataloader()` when none were `given`, or None (passed loaders)."""
    if datamodule is not None:
        check_source(datamodule, stage, given)
        return datamodule
    return module if own and has_loader(module, stage) else None


def _check_ckpt_path(ckpt_path: Any) -> None:
    if ckpt_path is not None and ckpt_path != "last" and not Path(ckpt_path).exists():
        raise FileNotFoundError(
            f"ckpt_path '{ckpt_path}' does not exist; allowed: an existing checkpoint directory, 'last' or None"
        )


def _check_not_empty(name: str, loader: Any) -> None:
    """A loader that says it has no batches is refused before anything starts (it would end the run later)."""
    try:
        length = len(loader)
    except TypeError:  # an iterable without len(): known only once read
        return
    if length == 0:
        raise ValueError(
            f"{name} is empty (len 0); allowed: a loader that yields at least one batch, or None"
        )


_WARNED_UNCALLED: set[type] = set()  # module classes told about their uncalled Lightning hooks


def _check_module(module: Any) -> None:
    if not isinstance(module, TrainModule):
        raise TypeError(f"expected a TrainModule, got {type(module).__name__}")
