"""Trainer: fit / validate / test. It owns the loop and nothing else; the strategy owns the parallelism."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from callbacks.base import Callback
from callbacks.checkpoint import ModelCheckpoint
from callbacks.compile_report import CompileReport
from strategies.base import Strategy, unpack_loss
from strategies.compile_blocks import check_compile
from strategies.registry import build_strategy
from trainer import checkpoint as ckpt
from trainer import flags, run_folder
from trainer.checkpoint import CheckpointError, step_dir_name
from trainer.data.loader import pin_for_device
from trainer.datamodule import call_if_defined, check_source, has_loader, loaders_from
from trainer.epochs import EpochBatches
from trainer.fused_optim import prefer_fused
from trainer.logging import (
    JSONLLogger,
    Logger,
    build_logger,
    configure_console_logging,
    log,
    rank_zero_info,
    set_rank,
)
from trainer.metrics import MetricBuffer
from trainer.module import TrainModule, uncalled_lightning_methods
from trainer.optim_config import SchedulerConfig, parse_optimizers
from trainer.precision import Precision
from trainer.progress import ProgressBar
from trainer.rng import isolated_rng, rng_state, seed_everything, set_rng_state
from trainer.schedules import SCHEDULES, LRSchedule, build_scheduler
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
        self.metrics = MetricBuffer()
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
        self._train_batches: EpochBatches | None = None
        self._progress: ProgressBar | None = None
        self._last_val_step: int | None = None
        self._module_name = ""
        self._was_deterministic = False
        # what callbacks may read or steer during a fit (see the "steering" section below)
        self.val_dataloaders: Iterable | None = None  # this rank's shard
        self.first_train_batch: Any = None  # the fit's first micro-batch on this rank, as the loader gave it
        self.step_loss: torch.Tensor | None = None  # this rank's loss of the step in progress
        self._step_norm: torch.Tensor | None = None
        self._skip_reason: str | None = None
        self._epoch_ending = False
        self._fit_start_step = 0
        self._step_logged = False  # the step that just ran was logged: so is what on_train_batch_end logs
        self.run_id: str | None = None  # this fit's (a resumed run's own), written into each checkpoint
        self._writer: dict[str, Any] | None = None  # rank zero's host and pid: who writes this run's files
        self._run_folder: Path | None = None  # the folder this fit claimed (trainer/run_folder.py)
        self._locks: list[run_folder.FolderLock] = []
        self._first_not_finite: torch.Tensor | None = None  # see not_finite_since

    # ---- public read-only views ------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        """The epoch in progress (at its end, through validation and on_train_epoch_end, still that one)."""
        return self.state.epoch - self._epoch_ending

    @property
    def in_training_step(self) -> bool:
        """Whether a training step or its batch hooks are running (not a validation inside it): where
        Lightning's `log` defaults to on_step=True, on_epoch=False (elsewhere the reverse)."""
        return self._step_hooks and not self.evaluating

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
        path = Path(path) if path is not None else self.checkpoint_dir / step_dir_name(self.global_step)
        if self.run_id is None:  # a save outside a fit (one process): a run of its own
            self.run_id = run_folder.new_run_id()
        owner = {"run_id": self.run_id, "writer": self._writer or run_folder.this_writer()}
        state: dict[str, Any] = {
            "loop": self.state.state_dict(),
            "rng": self.strategy.all_gather_object(rng_state(), group="world"),
            "scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else {},
            "precision": self.strategy.precision.state_dict(),
            "data": self._train_batches.state_dict() if self._train_batches is not None else {},
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "strategy": self.strategy.state_dict(),
            "module": {},
            "hyper_parameters": _plain(dict(self.module.hparams)),
            "meta": {**owner, **({"pending_validation": True} if pending_validation else {}), **(meta or {})},
        }
        self.module.on_save_checkpoint(state["module"])
        self._call("on_save_checkpoint", state)
        self.strategy.save_checkpoint(path, self.module, self.optimizer, state)
        return path

    # ---- steering: what callbacks may call during a fit ------------------------------------------
    def step_grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the step's gradients (before clipping), computed once per step. Call on every
        rank from on_before_optimizer_step (sharded strategies reduce it over ranks)."""
        if self._step_norm is None:
            self._step_norm = self.strategy.grad_norm(self.module)
        return self._step_norm

    def not_finite_since(self) -> int | None:
        """The first step of this fit whose loss was not finite on any rank, or None. Call on every rank."""
        first = self._first_not_finite
        mine = torch.tensor(math.inf) if first is None else first.detach().float().cpu()
        found = float(self.strategy.reduce(mine, "min", group="world"))
        return None if math.isinf(found) else int(found)

    def _track_finite(self, loss: torch.Tensor, step: int) -> None:
        """Remember the first step whose loss was not finite, on the device (no host sync per step)."""
        first = self._first_not_finite
        if first is None:
            first = self._first_not_finite = torch.full((), math.inf, device=loss.device)
        bad = ~torch.isfinite(loss.detach()) & torch.isinf(first)
        self._first_not_finite = torch.where(bad, torch.full_like(first, step), first)

    def skip_optimizer_step(self, reason: str) -> None:
        """Don't apply this step's update (call on every rank, from on_before_optimizer_step): parameters
        and optimizer state stay as they were; the data, the step counter and the LR schedule move on."""
        self._skip_reason = reason

    def rollback(self, before_step: int | None = None) -> Path:
        """Put model, optimizer, RNG streams, LR schedule and step counter back to the newest good checkpoint
        (of a step < `before_step`). The data stream goes on from where it is, so the batches since that
        checkpoint are not replayed (as PaLM does after a loss spike). Call on every rank between steps."""
        path, skipped = ckpt.find_last_good(
            self.checkpoint_dir,
            before_step,
            self.strategy.io_part,
            self._agree_on(self.checkpoint_dir),
            self.allow_unverified_checkpoints,
        )
        if skipped and self.is_global_zero:
            log.warning("".join(f"rollback: skipped {line}\n" for line in skipped).rstrip())
        if path is None:
            raise CheckpointError(
                f"rollback needs a good checkpoint{'' if before_step is None else f' before step {before_step}'}; "
                f"there is none in {self.checkpoint_dir}"
            )
        state = self.strategy.load_checkpoint(path, self.module, self.optimizer)
        loop = state["loop"]
        self.state.global_step, self.state.productive_s = loop["global_step"], loop.get("productive_s", 0.0)
        self.state.restarts += 1
        self._restore_rng(state)
        self._restore_schedule(state)
        if self._progress is not None:
            self._progress.reset(self.global_step)
        self._call("on_load_checkpoint", state)
        return path

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
        self.callback_metrics.update(metrics)
        for key, value in metrics.items():
            if key.endswith(("_step", "_epoch")):
                self.callback_metrics[key[: key.rindex("_")]] = value
        logged = {k: v for k, v in metrics.items() if k not in hidden}
        self.logged_metrics.update(logged)
        if self.is_global_zero and logged:
            for lg in self.loggers:
                lg.log_metrics(logged, self.global_step)

    def loss_on(self, batch: Any) -> torch.Tensor | None:
        """This rank's `validation_step` loss on `batch` in eval mode, without gradients, RNG or metric side
        effects; None when the step returns nothing (it only logs). Never `training_step`: it may count,
        log or change state. Call on every rank (sharded models gather)."""
        module = self.module
        if not _overrides(module, "validation_step"):
            raise TypeError(
                f"loss_on needs {type(module).__name__}.validation_step, which is not defined; "
                "allowed: a module that overrides validation_step"
            )
        was_training, pending = module.training, self.metrics
        # what the step logs goes to a buffer that is dropped, leaving a step's pending metrics untouched
        self.metrics = MetricBuffer()
        module.eval()
        try:
            with isolated_rng(), torch.no_grad():
                output = self.strategy.eval_step(
                    module, "validation_step", self.strategy.batch_to_device(batch), 0
                )
            return None if output is None else unpack_loss(output, "validation_step")[0].float()
        finally:
            self.metrics = pending
            module.train(was_training)

    def effective_training_time(self) -> dict[str, float]:
        """Productive step seconds over wall-clock seconds since the run first started (restarts,
        checkpoint and validation stalls, skipped and rolled-back steps are not productive)."""
        s = self.state
        wall = max(time.time() - s.started_at, 1e-9)
        return {"fraction": min(s.productive_s / wall, 1.0), "productive_s": s.productive_s, "wall_s": wall}

    def _effective_time_line(self) -> str:
        t, s = self.effective_training_time(), self.state
        return (
            f"effective training time {100 * t['fraction']:.1f}%: {t['productive_s']:.1f} s in kept steps of "
            f"{t['wall_s']:.1f} s since the run started ({s.restarts} restart(s)/rollback(s), "
            f"{s.skipped_steps} skipped step(s))"
        )

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
            self.val_dataloaders = val_loader
            self._train_batches = EpochBatches(train_loader, self.limit_train_batches)
            if self.limit_train_batches is not None and self._train_batches.epoch_length() == 0:
                raise ValueError(
                    f"limit_train_batches={self.limit_train_batches} leaves no batch of the train loader per "
                    "epoch; allowed: a limit that keeps at least one batch"
                )
            self._setup_optimizer(module)
            self._claim_run_folders(ckpt_path)
            resume_from = self._load_checkpoint(ckpt_path, self._restore)
            if resume_from is not None:
                self.state.restarts += 1
            else:
                self.state.started_at = time.time()
            if self.enable_model_summary:
                self._announce(module)
            if self.is_global_zero:
                for lg in self.loggers:
                    lg.setup(self.default_root_dir, self.global_step if resume_from is not None else None)
                    lg.log_hyperparams(self._hyperparams(module))
                if self.enable_progress_bar:
                    self._progress = ProgressBar(self._total_steps(), self.global_step)
            self._hook("on_fit_start")
            if val_loader is not None and self.num_sanity_val_steps and not self._val_at_start_due():
                self._sanity_check(module, val_loader)
            self._hook("on_train_start")
            self._train_loop(module, val_loader)
            self._hook("on_train_end")
            self._hook("on_fit_end")
            rank_zero_info(self._effective_time_line())
        except BaseException as exc:
            self._call("on_exception", exc)
            raise
        finally:
            self._finish("fit")

    def _train_loop(self, module: TrainModule, val_loader: Iterable | None) -> None:
        s = self.state
        self._fit_started = time.time()  # max_time counts this fit (a resumed run starts afresh)
        self._fit_start_step = s.global_step
        self._first_not_finite = None
        epoch_len = self._train_batches.epoch_length()
        val_every = self._val_every_n_steps(epoch_len)
        meter = _Throughput()
        if val_loader is not None and self._val_at_start_due():
            self._validation_loop(module, val_loader)  # the baseline the run's progress is read against
        while not self._done():
            self._hook("on_train_epoch_start")
            if not self._train_epoch(module, val_loader, epoch_len, val_every, meter):
                if s.batches_in_epoch:  # stopped inside the epoch (max_steps or should_stop): it ends here
                    self._hook("on_train_epoch_end")
                break
            if s.batches_in_epoch == 0:
                raise ValueError(
                    "the train loader yielded no batches in an epoch; it must yield at least one"
                )
            s.epoch += 1  # counted now, so a checkpoint written in what follows resumes at the next epoch
            s.batches_in_epoch = 0
            self._epoch_ending = True  # ...while current_epoch still names the one ending, as in Lightning
            try:
                if val_loader is not None and not val_every and s.epoch % self.check_val_every_n_epoch == 0:
                    self._validation_loop(module, val_loader)
                self._hook("on_train_epoch_end")
                self._log_epoch_metrics()
            finally:
                self._epoch_ending = False
            self._step_scheduler("epoch", s.epoch)  # after validation: ReduceLROnPlateau reads its metric
        self._log_epoch_metrics()  # a run that stopped inside an epoch ends that epoch's aggregates here
        if val_loader is not None and self._last_val_step != s.global_step:
            self._validation_loop(module, val_loader)

    def _val_at_start_due(self) -> bool:
        return self.val_at_start and self.state.global_step == 0

    def _sanity_check(self, module: TrainModule, loader: Iterable) -> None:
        """Lightning's sanity check: the first `num_sanity_val_steps` validation batches (-1: all) run
        before training so that a broken `validation_step` fails now, not after an epoch; nothing it
        logs is kept, and it draws no random numbers from the run's generators."""
        n = self.num_sanity_val_steps
        limit = self.limit_val_batches
        if n != -1:
            full = EpochBatches(loader, limit, "limit_val_batches").epoch_length()
            limit = n if full is None else min(n, full)
        self.sanity_checking = True
        try:
            self._call("on_sanity_check_start")
            with self._eval_mode(module, "validation"):
                self._hook("on_validation_start")
                self._eval_loop(module, loader, "validation_step", "val", limit)
                self._hook("on_validation_end")
            self._call("on_sanity_check_end")
        finally:
            self.sanity_checking = False

    def _log_epoch_metrics(self) -> None:
        """What training steps logged with on_epoch=True, aggregated over the epoch, then reset."""
        metrics = self.metrics.compute_epoch(self._reduce_logged)
        if metrics:
            self.log_metrics(metrics, hidden=self.metrics.not_for_loggers())
        self.metrics.reset()

    def _reduce_logged(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """`sync_dist`: over the ranks that hold different data (and sequence shards)."""
        return self.strategy.reduce(tensor, op, group="loss")

    def _train_epoch(
        self,
        module: TrainModule,
        val_loader: Iterable | None,
        epoch_len: int | None,
        val_every: int | None,
        meter: _Throughput,
    ) -> bool:
        """Optimizer steps until the epoch's data runs out (True) or the run is done (False)."""
        s = self.state
        iterator = self._train_batches.begin(s.epoch, s.batches_in_epoch)
        while not self._done():
            remaining = None if epoch_len is None else epoch_len - s.batches_in_epoch
            started = time.perf_counter()
            with self.clock.phase("data"):
                window = _take(iterator, self.accumulate_grad_batches, remaining)
            if not window:
                return True
            first_idx = s.batches_in_epoch
            self._step_hooks = True
            try:
                outputs = self._optimizer_step(module, window, meter, started)
                if val_loader is not None and val_every and s.global_step % val_every == 0:
                    self._validation_loop(module, val_loader)
                self._step_hook("on_train_batch_end", (outputs,), (outputs, window[0], first_idx))
            finally:
                self._step_hooks = False
            self._end_step()
        return False

    def _optimizer_step(
        self, module: TrainModule, window: list[Any], meter: _Throughput, started: float
    ) -> dict[str, Any]:
        """Forward+backward every micro-batch of `window`, then clip and step once. The time since
        `started` (the data fetch) is productive unless the update is skipped; what follows (logging,
        validation, checkpoints in batch-end callbacks) is not."""
        s, strategy = self.state, self.strategy
        if self.first_train_batch is None:
            self.first_train_batch = window[0]
        self._step_hook("on_train_batch_start", (s.batches_in_epoch,), (window[0], s.batches_in_epoch))
        for batch in window:
            samples, tokens = meter.count(batch)
            s.samples_seen += samples
            s.tokens_seen += tokens or 0
        out = strategy.train_step(module, window, s.batches_in_epoch)  # forward+backward of the window
        if out is None:  # a training_step returned None (on some rank): no update, as in Lightning
            return self._skip_returned_none(window)
        loss, num_tokens = out.loss, out.num_tokens
        self.step_loss, self._step_norm, self._skip_reason = loss, None, None
        strategy.finish_gradients(module, self.optimizer, num_tokens)
        self._step_hook("on_after_backward")
        log_now = (s.global_step + 1) % self.log_every_n_steps == 0 or s.global_step + 1 == self.max_steps
        if self.gradient_clip_val is not None:
            self._step_norm = strategy.clip_gradients(
                module, self.gradient_clip_val, self.gradient_clip_algorithm
            )
        elif log_now:
            self.step_grad_norm()
        self._step_hook("on_before_optimizer_step", (self.optimizer,))
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = self._skip_reason is not None
        with self.clock.phase("optimizer"):
            if skipped:
                strategy.precision.skip_step()
            else:  # False: fp16's loss scaler dropped the update for inf/nan gradients
                skipped = not strategy.optimizer_step(self.optimizer)
            s.skipped_steps += skipped
            self._step_hook("on_before_zero_grad", (self.optimizer,))
            self.optimizer.zero_grad(set_to_none=True)
            self._step_scheduler("step", s.global_step + 1)
        strategy.after_optimizer_step()
        if not skipped:
            s.productive_s += time.perf_counter() - started
        self._track_finite(loss, s.global_step)  # the model as of this step gave a non-finite loss
        s.global_step += 1
        s.batches_in_epoch += len(window)
        meter.step_done()
        if log_now:  # written now, before batch-end callbacks (a checkpoint, a stop) can interrupt
            self._log_train(loss, num_tokens, lr, self._step_norm, meter)
        self.metrics.reset_step()
        self._step_logged = log_now
        return {"loss": loss, "skipped": skipped}

    def _end_step(self) -> None:
        """After on_train_batch_end: what it logged per step belongs to the step that just ended (as in
        Lightning), so it is logged at that step when the step was; then the step's metrics clear."""
        extra = self.metrics.compute_step(self._reduce_logged) if self._step_logged else {}
        if extra:
            self.log_metrics(extra, hidden=self.metrics.not_for_loggers())
        self._step_logged = False
        self.metrics.reset_step()
        if self._progress is not None:
            self._progress.update()
        self.step_loss = self._step_norm = None

    def _log_train(
        self, loss: torch.Tensor, num_tokens: torch.Tensor | None, lr: float, norm: Any, meter: _Throughput
    ) -> None:
        """The step's row: loss, learning rate, grad norm, rates, and what the step logged per step."""
        strategy = self.strategy
        if num_tokens is not None:  # token-weighted mean over ranks
            total = strategy.reduce(torch.stack([loss * num_tokens, num_tokens]), "sum", group="loss")
            loss = total[0] / total[1]
        else:
            loss = strategy.reduce(loss, "mean", group="loss")
        metrics = {"train/loss": float(loss), "train/lr": lr, "epoch": self.state.epoch}
        if norm is not None:
            metrics["train/grad_norm"] = float(norm)
        metrics.update(meter.rates(strategy.dp_size))
        metrics.update(strategy.step_metrics())
        metrics["train/effective_time"] = self.effective_training_time()["fraction"]
        if self.state.skipped_steps:
            metrics["train/skipped_steps"] = self.state.skipped_steps
        user = self.metrics.compute_step(self._reduce_logged)
        metrics.update(user)
        self.log_metrics(metrics, hidden=self.metrics.not_for_loggers())
        if self._progress is not None:  # rank zero's
            shown = {"loss": metrics["train/loss"], "lr": lr}
            if "train/tokens_per_s" in metrics:
                shown["tok/s"] = metrics["train/tokens_per_s"]
            shown.update({k: v for k, v in user.items() if k in self.metrics.prog_bar_names})
            self._progress.show(shown)

    # ---- evaluation ------------------------------------------------------------------------------
    def _validation_loop(self, module: TrainModule, loader: Iterable) -> dict[str, float]:
        with self._eval_mode(module, "validation"):
            self._hook("on_validation_start")
            metrics, hidden = self._eval_loop(
                module, loader, "validation_step", "val", self.limit_val_batches
            )
            self.log_metrics(metrics, hidden)
            self._last_val_step = self.global_step
            if self._progress is not None and "val/loss" in metrics:
                self._progress.write(f"step {self.global_step}: val/loss {metrics['val/loss']:.4f}")
            self._hook("on_validation_end")
        return metrics

    @contextlib.contextmanager
    def _eval_mode(self, module: TrainModule, stage: str) -> Iterator[None]:
        """Lightning's `on_<stage>_model_eval` around a whole loop (its start and end hooks included),
        then `on_<stage>_model_train` if the module was training."""
        was_training = module.training
        getattr(module, f"on_{stage}_model_eval")()
        try:
            yield
        finally:
            if was_training:
                getattr(module, f"on_{stage}_model_train")()

    def _eval_loop(
        self, module: TrainModule, loader: Iterable, method: str, prefix: str, limit: Any
    ) -> tuple[dict[str, float], set[str]]:
        """Means over batches (and ranks) of the step's returned loss and of what it logged, and the
        names logged with logger=False. It runs with its own RNG so that validating never changes the
        training trajectory."""
        training_metrics = self.metrics
        stage = "validation" if method == "validation_step" else "test"
        limit_name = f"limit_{'val' if stage == 'validation' else 'test'}_batches"
        n_batches = EpochBatches(loader, limit, limit_name).epoch_length()
        self.metrics = MetricBuffer()  # a validation inside an epoch leaves the epoch's aggregates alone
        self.evaluating = True
        losses: list[torch.Tensor] = []
        try:
            self._hook(f"on_{stage}_epoch_start")
            with isolated_rng(), torch.no_grad():
                for idx, batch in enumerate(loader):
                    if n_batches is not None and idx >= n_batches:
                        break
                    batch = self.strategy.batch_to_device(batch)
                    self._hook(f"on_{stage}_batch_start", batch, idx)
                    output = self.strategy.eval_step(module, method, batch, idx)
                    self._hook(f"on_{stage}_batch_end", output, batch, idx)
                    if output is not None:
                        losses.append(unpack_loss(output, method)[0].float())
                self._hook(f"on_{stage}_epoch_end")  # what it logs belongs to this loop
            metrics = self.metrics.compute_epoch(self._reduce_logged)
            hidden = self.metrics.not_for_loggers()
        finally:
            self.metrics, self.evaluating = training_metrics, False
        if losses:
            metrics[f"{prefix}/loss"] = float(
                self.strategy.reduce(torch.stack(losses).mean(), "mean", group="loss")
            )
        return metrics, hidden

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
            self._load_checkpoint(ckpt_path, lambda path: self.strategy.load_checkpoint(path, module, None))
            if stage == "predict":
                return self._predict_loop(module, loader)
            method, prefix = ("validation_step", "val") if stage == "validate" else ("test_step", "test")
            loop = "validation" if stage == "validate" else "test"
            limit = self.limit_val_batches if stage == "validate" else self.limit_test_batches
            with self._eval_mode(module, loop):
                self._hook(f"on_{loop}_start")
                metrics, _ = self._eval_loop(module, loader, method, prefix, limit)
                self._hook(f"on_{loop}_end")
            if self.is_global_zero and self.enable_progress_bar:
                print("  ".join(f"{k} {v:.4f}" for k, v in metrics.items()), file=sys.stderr)
            return metrics
        finally:
            self._finish(stage)

    def _predict_loop(self, module: TrainModule, loader: Iterable) -> list[Any]:
        was_training = module.training
        module.on_predict_model_eval()  # Lightning has no on_predict_model_train: the mode is restored
        n_batches = EpochBatches(loader, self.limit_predict_batches, "limit_predict_batches").epoch_length()
        predictions = []
        self._hook("on_predict_start")
        self._hook("on_predict_epoch_start")
        with isolated_rng(), torch.no_grad():
            for idx, batch in enumerate(loader):
                if n_batches is not None and idx >= n_batches:
                    break
                batch = self.strategy.batch_to_device(batch)
                self._hook("on_predict_batch_start", batch, idx)
                predictions.append(self.strategy.eval_step(module, "predict_step", batch, idx))
                self._hook("on_predict_batch_end", predictions[-1], batch, idx)
        self._hook("on_predict_epoch_end")
        self._hook("on_predict_end")
        module.train(was_training)
        return predictions

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
        self._call("setup", stage)
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

    def _setup_optimizer(self, module: TrainModule) -> None:
        optimizer, self._scheduler_config = parse_optimizers(module.configure_optimizers())
        self.optimizer = self.strategy.setup_optimizer(prefer_fused(optimizer))
        if self._scheduler_config is not None:
            if self.lr_schedule != "constant" or self.warmup_steps:
                raise ValueError(
                    f"configure_optimizers returned its own lr_scheduler and the Trainer has lr_schedule={self.lr_schedule!r}, "
                    f"warmup_steps={self.warmup_steps}; allowed: one of the two (leave the Trainer's at 'constant', 0)"
                )
            self.lr_scheduler = self._scheduler_config.scheduler
            return
        total = self._total_steps()
        if self.lr_schedule != "constant" and total is None:
            raise ValueError(
                f"lr_schedule={self.lr_schedule!r} needs the run length: set max_steps, or use a loader with len()"
            )
        self._schedule = LRSchedule(self.lr_schedule, self.warmup_steps, total or 1, self.min_lr_ratio)
        self.lr_scheduler = build_scheduler(self.optimizer, self._schedule)

    def _skip_returned_none(self, window: list[Any]) -> dict[str, Any]:
        """training_step returned None: the step counts (as in Lightning, where the optimizer is still
        called with no gradients) but updates nothing; what the window accumulated is dropped."""
        s = self.state
        if not self._warned_none_step:
            self._warned_none_step = True
            rank_zero_info(
                f"training_step returned None at step {s.global_step + 1}: that optimizer step is skipped on "
                "every rank (said once per run)"
            )
        self.optimizer.zero_grad(set_to_none=True)
        s.global_step += 1
        s.skipped_steps += 1
        s.batches_in_epoch += len(window)
        self._step_scheduler("step", s.global_step)
        self.metrics.reset_step()
        return {"loss": None, "skipped": True}

    def _step_scheduler(self, interval: str, count: int) -> None:
        """The Trainer's own schedule steps every optimizer step; a module's scheduler at its interval."""
        config = self._scheduler_config
        if config is None:
            if interval == "step":
                self.lr_scheduler.step()
        elif config.interval == interval:
            config.step(count, self.callback_metrics)

    def _total_steps(self) -> int | None:
        """Optimizer steps the fit will take, if knowable."""
        per_epoch = None
        length = self._train_batches.epoch_length() if self._train_batches is not None else None
        if length is not None:
            per_epoch = math.ceil(length / self.accumulate_grad_batches)
        by_epochs = per_epoch * self.max_epochs if per_epoch is not None and self.max_epochs else None
        candidates = [n for n in (self.max_steps, by_epochs) if n is not None]
        return min(candidates) if candidates else None

    def _val_every_n_steps(self, epoch_len: int | None) -> int | None:
        """Steps between validations; None = at the end of each epoch."""
        interval = self.val_check_interval
        if interval is None or isinstance(interval, int):
            return interval
        if epoch_len is None:
            raise ValueError(
                f"val_check_interval={interval} is a fraction of an epoch but the loader has no len(); pass an int"
            )
        return max(1, round(interval * math.ceil(epoch_len / self.accumulate_grad_batches)))

    def _done(self) -> bool:
        s = self.state
        if self.max_time is not None and not self.should_stop:
            # every rank must stop at the same step: one agreed flag (a collective only with processes)
            if self.strategy.any_rank(time.time() - self._fit_started >= self.max_time):
                self.should_stop = True
                rank_zero_info(f"stopping at step {s.global_step}: max_time of {self.max_time:.0f} s reached")
        reason = None if self.should_stop else self.strategy.stop_reason()
        if reason is not None:
            if s.global_step > self._fit_start_step:  # this fit trained: keep where it stopped
                self.save_and_stop(reason, resumable=False)
            else:
                self.should_stop = True
                rank_zero_info(f"stopping at step {s.global_step} before training: {reason}")
        return (
            self.should_stop
            or (self.max_steps is not None and s.global_step >= self.max_steps)
            or (self.max_epochs is not None and s.epoch >= self.max_epochs)
        )

    def _finish(self, stage: str) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        self.strategy.teardown()  # first: it completes checkpoints still being written
        for lock in self._locks:  # then this fit's folders are free for the next one
            lock.release()
        self._locks = []
        self._call("teardown", stage)
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
        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    @property
    def checkpoint_dir(self) -> Path:
        """This run's checkpoint folder: the one this fit claimed (trainer/run_folder.py), else the newest
        run's under the ModelCheckpoint's dirpath or `<default_root_dir>/checkpoints` (what "last" reads)."""
        if self._run_folder is not None:
            return self._run_folder
        saver = self.checkpoint_callback
        return run_folder.newest(
            saver.base_dir(self) if saver is not None else self.default_root_dir / "checkpoints"
        )

    def _claim_run_folders(self, ckpt_path: Any) -> None:
        """Rank zero picks and locks the folder of each ModelCheckpoint, before anything is trained (a fresh
        run never shares one with an earlier run; a second live fit is refused); every rank learns the
        folders and the run id."""
        savers = [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]
        claimed: Any = None
        if self.is_global_zero:
            try:
                claimed = run_folder.claim([cb.base_dir(self) for cb in savers], ckpt_path, self._locks)
            except (run_folder.FolderInUse, OSError) as err:
                claimed = str(err)
        claimed = self.strategy.broadcast_object(claimed)
        if isinstance(claimed, str):
            raise run_folder.FolderInUse(claimed)
        for cb, folder in zip(savers, claimed.folders, strict=True):
            cb.dirpath = Path(folder)
        self._run_folder = Path(claimed.folders[0]) if savers else None
        self.run_id, self._writer = claimed.run_id, claimed.writer
        for line in claimed.notes if self.is_global_zero else ():
            log.warning(line)

    def _load_checkpoint(self, ckpt_path: Any, load: Any) -> Path | None:
        """Verify (every rank hashes its share) and `load(path)` the checkpoint `ckpt_path` names; "last" is
        the newest good one of this run's folder, falling back past any that fails to load, each named.
        Returns the checkpoint loaded, or None (nothing to resume)."""
        if ckpt_path is None:
            return None
        strategy, allow = self.strategy, self.allow_unverified_checkpoints
        if ckpt_path != "last":  # fail early, on every rank, with what is wrong with the files
            ckpt.check_good(ckpt_path, strategy.io_part, self._agree_on(Path(ckpt_path)), allow)
            load(Path(ckpt_path))
            return Path(ckpt_path)
        folder, before, refused, failed = self.checkpoint_dir, None, [], False
        while True:
            found, skipped = ckpt.find_last_good(
                folder, before, strategy.io_part, self._agree_on(ckpt.find_last(folder)), allow
            )
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
            before, failed = ckpt.read_meta(found)["step"], True
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
            line = f"resuming from {found}: step {meta['step']}, saved {saved}"
        if not refused:
            rank_zero_info(line)
        elif self.is_global_zero:  # what was refused, and why, is worth a warning
            log.warning("".join(f"ckpt_path='last': skipped {s}\n" for s in refused) + line)
        return found

    def _agree_on(self, ckpt_dir: Path | None) -> ckpt.Agree:
        """How the ranks combine their verdicts on a checkpoint, each having hashed its share; the waits
        are sized to that share of `ckpt_dir`'s bytes (the newest candidate)."""
        self.strategy.begin_io(ckpt.manifest_bytes(ckpt_dir) // self.strategy.world_size)
        return self.strategy.agree

    def _restore_rng(self, state: dict[str, Any]) -> None:
        """This rank's RNG streams as saved (rank 0's when the world size changed)."""
        rngs = state["rng"]
        set_rng_state(rngs[self.strategy.global_rank] if len(rngs) == self.strategy.world_size else rngs[0])

    def _restore(self, path: Path) -> None:
        state = self.strategy.load_checkpoint(path, self.module, self.optimizer)
        self.state.load_state_dict(state["loop"])
        self._restore_rng(state)
        self._restore_schedule(state)
        self._train_batches.load_state_dict(state["data"])
        self.strategy.load_state_dict(state.get("strategy", {}))
        for cb in self.callbacks:
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        self.module.on_load_checkpoint(state["module"])
        self._call("on_load_checkpoint", state)

    def _restore_schedule(self, state: dict[str, Any]) -> None:
        """The LR schedule's position and the gradient scaler, from a checkpoint's state."""
        if self._schedule is not None:
            # our schedule is rebuilt from this run's flags (a run may be extended); only its position is restored
            self.lr_scheduler.load_state_dict(
                {**state["scheduler"], "lr_lambdas": [None] * len(self.optimizer.param_groups)}
            )
            for group, base in zip(self.optimizer.param_groups, self.lr_scheduler.base_lrs, strict=True):
                group["lr"] = base * self._schedule(self.lr_scheduler.last_epoch)
        elif state["scheduler"]:
            self.lr_scheduler.load_state_dict(state["scheduler"])
        self.strategy.precision.load_state_dict(state["precision"])

    # ---- small helpers ---------------------------------------------------------------------------
    def _loader(self, loader: Iterable, train: bool) -> Iterable:
        """The loader this rank reads, as the strategy decides (by default: its share of the batch group);
        ours pins its batches for a GPU, so that their copies there don't wait for the step in flight."""
        loader = self.strategy.process_dataloader(loader, self.seed or 0, train=train)
        pin_for_device(loader, self.strategy.root_device)
        return loader

    def _announce(self, module: TrainModule) -> None:
        """One line on what is about to run: size, parallelism, precision and the global batch."""
        strategy = self.strategy
        # a pipeline stage holds some of the blocks: the model's size is the sum over the stages
        local = torch.tensor(float(sum(p.numel() for p in module.parameters())), device=strategy.root_device)
        params = float(strategy.reduce(local, "sum", group="pp"))
        batch = getattr(self._train_batches.loader, "batch_size", None)
        line = (
            f"{self._module_name}: {params / 1e6:.2f}M parameters | strategy {strategy.name}, "
            f"{strategy.world_size} process(es), precision {strategy.precision.name}"
        )
        if isinstance(batch, int):
            line += (
                f" | global batch = {batch} per micro-batch x {self.accumulate_grad_batches} accumulated x "
                f"{strategy.dp_size} data-parallel = {batch * self.accumulate_grad_batches * strategy.dp_size} samples/step"
            )
        rank_zero_info(line)
        report = strategy.startup_report(module)
        if report:
            rank_zero_info(report)

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, self.module, *args)

    def _hook(self, hook: str, *args: Any) -> None:
        """Lightning's order: the callbacks' hook, then the module's."""
        self._call(hook, *args)
        getattr(self.module, hook)(*args)

    # who implements each per-step hook, for the module and callbacks in `_hook_owners_key`
    _hook_owners_key: tuple = ()
    _hook_owners: dict[str, tuple[list[Callback], bool]] | None = None

    def _step_hook(self, hook: str, args: tuple = (), module_args: tuple | None = None) -> None:
        """A hook that runs every step, in `_hook`'s order (the module gets `module_args` where its
        signature differs); the callbacks and module that leave it as the base class's no-op are skipped."""
        key = (self.module, *self.callbacks)
        owners = self._hook_owners.get(hook) if key == self._hook_owners_key else None
        callbacks, module_too = owners or self._find_hook_owners(key, hook)
        for cb in callbacks:
            getattr(cb, hook)(self, self.module, *args)
        if module_too:
            getattr(self.module, hook)(*(args if module_args is None else module_args))

    def _find_hook_owners(self, key: tuple, hook: str) -> tuple[list[Callback], bool]:
        """The callbacks that implement `hook`, and whether the module does; remembered until the module or
        the list of callbacks (`key`) changes, so a step pays nothing for the hooks nobody uses."""
        if key != self._hook_owners_key:
            self._hook_owners_key, self._hook_owners = key, {}
        owners = self._hook_owners[hook] = (
            [cb for cb in self.callbacks if _implements(cb, hook, Callback)],
            _implements(self.module, hook, TrainModule),
        )
        return owners

    def _hyperparams(self, module: TrainModule) -> dict[str, Any]:
        keys = (
            "max_steps",
            "max_epochs",
            "accumulate_grad_batches",
            "gradient_clip_val",
            "lr_schedule",
            "warmup_steps",
            "min_lr_ratio",
            "seed",
            "log_every_n_steps",
        )
        params = {k: getattr(self, k) for k in keys}
        params.update(
            strategy=self.strategy.name,
            precision=self.strategy.precision.name,
            world_size=self.strategy.world_size,
            module=self._module_name,
            parameters=sum(p.numel() for p in module.parameters()),
        )
        if module.hparams:
            params["hparams"] = _plain(dict(module.hparams))
        return params


class _Throughput:
    """Samples and tokens consumed since the last logged step, turned into per-second rates."""

    def __init__(self) -> None:
        self.samples = self.tokens = self.steps = 0
        self.has_tokens = True
        self.since = time.perf_counter()

    def count(self, batch: Any) -> tuple[int, int | None]:
        """Count a micro-batch; returns its (samples, tokens)."""
        samples, tokens = _batch_size(batch)
        self.samples += samples
        if tokens is None:
            self.has_tokens = False
        else:
            self.tokens += tokens
        return samples, tokens

    def step_done(self) -> None:
        self.steps += 1

    def rates(self, dp_size: int) -> dict[str, float]:
        """Global rates (this rank's count x data-parallel replicas) since the last call."""
        elapsed = max(time.perf_counter() - self.since, 1e-9)
        rates = {
            "train/step_time_s": elapsed / max(self.steps, 1),
            "train/samples_per_s": self.samples * dp_size / elapsed,
        }
        if self.has_tokens and self.tokens:
            rates["train/tokens_per_s"] = self.tokens * dp_size / elapsed
        self.samples = self.tokens = self.steps = 0
        self.since = time.perf_counter()
        return rates


def _batch_size(batch: Any) -> tuple[int, int | None]:
    """(samples, tokens) of a batch: tokens are counted when it carries `input_ids` (a dict key, or a 2-D
    integer tensor as the batch or its first element)."""
    ids = None
    if isinstance(batch, dict):
        ids = batch.get("input_ids")
        first = (
            ids if ids is not None else next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        )
    else:
        first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
        if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
            ids = first
    samples = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() > 0 else 1
    return samples, (ids.numel() if isinstance(ids, torch.Tensor) else None)


def _take(iterator: Any, k: int, remaining: int | None) -> list[Any]:
    """Up to k next batches (fewer at the end of the epoch or of `remaining`)."""
    return list(itertools.islice(iterator, k if remaining is None else max(0, min(k, remaining))))


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


def _overrides(module: TrainModule, method: str) -> bool:
    return getattr(type(module), method) is not getattr(TrainModule, method)


def _implements(obj: Any, hook: str, base: type) -> bool:
    """Whether `obj`'s `hook` may do something: its class overrides `base`'s no-op, or the instance has
    its own (a function set on it)."""
    return getattr(type(obj), hook, None) is not getattr(base, hook) or hook in getattr(obj, "__dict__", ())


_WARNED_UNCALLED: set[type] = set()  # module classes told about their uncalled Lightning hooks


def _plain(value: Any) -> Any:
    """`value` in types a checkpoint loads with weights_only and a JSON log can hold; others as repr."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def _check_module(module: Any) -> None:
    if not isinstance(module, TrainModule):
        raise TypeError(f"expected a TrainModule, got {type(module).__name__}")
