"""One fit's loop: epochs of optimizer steps, each a window of micro-batches, with validation, logging
and the stop conditions between them. A `FitLoop` is made per fit and owns that fit's state (the step in
progress, its loss and norm, the data position, the progress bar); the Trainer reads it through its
views and steers it through its control methods."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from trainer.checkpoint.layout import read_meta
from trainer.core.fused_optim import prefer_fused
from trainer.core.logging import rank_zero_info
from trainer.core.schedules import LRSchedule, build_scheduler
from trainer.fault_tolerance.quorum import Healed
from trainer.loop import eval_loop, step_log
from trainer.loop.epochs import EpochBatches
from trainer.loop.finiteness import LossWatch
from trainer.loop.optim_config import parse_optimizers
from trainer.loop.progress import ProgressBar
from trainer.loop.reload import LoaderReload
from trainer.loop.state import LoopState
from trainer.loop.step_log import Throughput
from trainer.loop.stop_signals import StopSignals
from trainer.loop.stopping import StopConditions
from trainer.loop.time_limit import TimeLimit
from trainer.loop.val_timer import ValTimer
from trainer.module import TrainModule

if TYPE_CHECKING:
    from trainer.fault_tolerance.replica_group import ReplicaGroup
    from trainer.trainer import Trainer


class FitLoop(StopConditions):
    """The loop of one `Trainer.fit` on this rank: `run` sets up, then trains epoch by epoch until done."""

    def __init__(
        self, trainer: Trainer, module: TrainModule, train_loader: Iterable, val_loader: Iterable | None
    ) -> None:
        self.trainer, self.module, self.val_loader = trainer, module, val_loader
        # reload_dataloaders_every_n_epochs: when the loaders are read again (set by stages; default: never)
        self.reload = LoaderReload()
        self.train_batches = EpochBatches(train_loader, trainer.limit_train_batches)
        # Lightning's limit_train_batches=0: the fit skips training (its sanity check still runs)
        self.skip_training = trainer.limit_train_batches == 0
        limit = trainer.limit_train_batches
        if limit is not None and not self.skip_training and self.train_batches.epoch_length() == 0:
            raise ValueError(
                f"limit_train_batches={limit} leaves no batch of the train loader per epoch; allowed: a limit "
                "that keeps at least one batch, or 0 (no training)"
            )
        self.progress: ProgressBar | None = None  # rank zero's, with enable_progress_bar
        self.first_train_batch: Any = None  # the fit's first micro-batch on this rank, as the loader gave it
        self.step_loss: torch.Tensor | None = None  # this rank's loss of the step in progress
        self.step_norm: torch.Tensor | None = None  # its gradients' norm, once computed
        self.skip_reason: str | None = None  # why a callback skips the step's update
        self.step_logged = False  # the step that just ran was logged: so is what on_train_batch_end logs
        self.ending_epoch: int | None = (
            None  # the epoch ending, through its validation and on_train_epoch_end
        )
        self.last_val_step: int | None = None
        self.val_timer: ValTimer | None = None  # val_check_interval as a time, once training started
        self.epoch_scheduler_stepped = False  # in the epoch's last batch (`_step_epoch_scheduler_early`)
        self.val_batches_seen = 0  # this fit's validation batches (not the sanity check's): their rows' step
        self.started = 0.0  # time.time() when training started: max_time counts this fit
        self.start_step = 0
        self.time_limit: TimeLimit | None = None  # max_time, once training started
        self.losses = LossWatch(trainer.strategy)  # the first non-finite step, the end-of-fit check
        self.signals = StopSignals()  # Ctrl-C / SIGTERM while the fit runs
        self.stopped_by: int | None = None  # the signal the ranks agreed to stop for
        self.stop_checkpoint: Any = None  # the checkpoint saved for that stop (None: no step to save)
        self.must_stop = False  # a stop min_steps/min_epochs do not hold back (see `stop_now`)
        self.replicas: ReplicaGroup | None = None  # fault tolerance's replica group (set by stages), or None

    # ---- the run ---------------------------------------------------------------------------------
    def run(self, ckpt_path: Any) -> None:
        """Optimizer, run folders and resume; then Lightning's fit: its hooks around the epochs. Ctrl-C and
        SIGTERM stop it after the step in flight, with a checkpoint (see `signal_exit`)."""
        self.signals.install()
        try:
            self._run(ckpt_path)
            self.signals.finish()
        finally:
            self.signals.restore()

    def _run(self, ckpt_path: Any) -> None:
        trainer, module, val_loader = self.trainer, self.module, self.val_loader
        dispatch = trainer._dispatch
        began = time.time()
        trainer.strategy.before_backward = self._before_backward
        self.setup_optimizer()
        trainer.checkpoint_manager.claim(ckpt_path)
        resume_from = trainer.checkpoint_manager.resume(ckpt_path)
        if resume_from is not None:
            trainer.state.restarts += 1
            # the time the run sat stopped (from its checkpoint to this fit) is no time of the run's
            saved = read_meta(resume_from).get("time", began)
            trainer.state.started_at += max(0.0, began - saved)
        else:
            trainer.state.started_at = time.time()
        if trainer.enable_model_summary:
            step_log.announce(trainer, module)
        step_log.start_loggers(trainer, module, resume_from is not None)
        # a TQDMProgressBar/RichProgressBar callback says how the bar is drawn (refresh_rate 0: none)
        bar = trainer.progress_bar_callback
        if trainer.is_global_zero and trainer.enable_progress_bar and (bar is None or bar.is_enabled):
            options = {} if bar is None else bar.bar_options()
            self.progress = ProgressBar(self.total_steps(), trainer.global_step, **options)
        dispatch.all("on_fit_start")
        if val_loader is not None and trainer.num_sanity_val_steps and not self._val_at_start_due():
            eval_loop.sanity_check(trainer, module, self._current_val_loader())
        if not self.skip_training:
            dispatch.all("on_train_start")
            self._train()
            dispatch.all("on_train_end")
        dispatch.all("on_fit_end")
        # rank zero's rows on disk before the fit's last collective: any rank may read them after fit returns
        if trainer.is_global_zero:
            for lg in trainer.loggers:
                lg.save()
        # after ModelCheckpoint's last save, which names the last good checkpoint
        self.losses.check_end(module)
        rank_zero_info(step_log.effective_time_line(trainer))

    def _train(self) -> None:
        trainer, s, val_loader = self.trainer, self.trainer.state, self.val_loader
        self.started = time.time()  # max_time counts this fit (a resumed run starts afresh)
        self.start_step = s.global_step
        if trainer.max_time is not None:
            self.time_limit = TimeLimit(trainer.max_time, s.global_step, trainer.strategy.world_size > 1)
        self.val_timer = ValTimer.for_fit(trainer, self._slowest)
        epoch_len = self.train_batches.epoch_length()
        val_every = self._val_every_n_steps(epoch_len)
        meter = Throughput()
        # resumed from a checkpoint of an epoch's last batch: its scheduler stepped before that was written
        self.epoch_scheduler_stepped = epoch_len is not None and s.batches_in_epoch >= epoch_len > 0
        if val_loader is not None and self._val_at_start_due():
            # the baseline the run's progress is read against
            self._validate()
        while self._goes_on():
            # a train loader read again comes before on_train_epoch_start, as in Lightning
            if self.reload.train(self.train_batches, s.epoch):
                epoch_len = self.train_batches.epoch_length()
                val_every = self._val_every_n_steps(epoch_len)
                if self.val_timer is not None:  # as Lightning's loader set-up restarts its interval
                    self.val_timer.restart(s.global_step)
            trainer._dispatch.all("on_train_epoch_start")
            if not self._epoch(epoch_len, val_every, meter):
                if epoch_len is not None and s.batches_in_epoch >= epoch_len:
                    # the step that stopped the fit took the epoch's last batch: the epoch is done (a resume
                    # starts the next one), as Lightning counts it
                    self._end_epoch(val_every)
                elif s.batches_in_epoch:  # stopped inside the epoch (max_steps or should_stop): it ends here
                    trainer._dispatch.train_epoch_end(lambda: step_log.log_epoch_metrics(trainer))
                break
            self._end_epoch(val_every)
        step_log.log_epoch_metrics(trainer)  # a run stopped inside an epoch ends its aggregates here
        if val_loader is not None and self.last_val_step != s.global_step and self.stopped_by is None:
            self._validate()

    def _end_epoch(self, val_every: int | None) -> None:
        """An epoch whose data ran out: validation (at epoch ends), its hooks, aggregates, schedule."""
        trainer, s = self.trainer, self.trainer.state
        if s.batches_in_epoch == 0:
            raise ValueError("the train loader yielded no batches in an epoch; it must yield at least one")
        # current_epoch still names the one ending, as in Lightning, while the count moves on now, so that a
        # checkpoint written in what follows resumes at the next epoch
        self.ending_epoch = s.epoch
        s.epoch += 1
        s.batches_in_epoch = 0
        if self.progress is not None:
            self.progress.end_epoch()
        try:
            if (
                self.val_loader is not None
                and not val_every
                and self.val_timer is None
                and s.epoch % trainer.check_val_every_n_epoch == 0
            ):
                self._validate()
            trainer._dispatch.train_epoch_end(lambda: step_log.log_epoch_metrics(trainer))
        finally:
            self.ending_epoch = None
        # ReduceLROnPlateau (it reads the validation's metric), or a loader without len: at the epoch's end
        if not self.epoch_scheduler_stepped:
            self.step_scheduler("epoch", s.epoch)
        self.epoch_scheduler_stepped = False

    def _epoch(self, epoch_len: int | None, val_every: int | None, meter: Throughput) -> bool:
        """Optimizer steps until the epoch's data runs out (True) or the run is done (False)."""
        trainer, s, val_loader = self.trainer, self.trainer.state, self.val_loader
        iterator = self.train_batches.begin(s.epoch, s.batches_in_epoch)
        timer = self.val_timer  # a time-based validation may fall in this epoch:
        timed = timer is not None and val_loader is not None and timer.checks_epoch(s.epoch)
        while self._goes_on():
            try:
                # fault tolerance: the step's quorum forms while the step reads its data and runs its forward
                if self.replicas is not None:
                    self.replicas.start_step()
                ran = self._train_step(iterator, epoch_len, val_every, timed, meter)
            except Healed:
                # the quorum gave this group a peer's state: the step again, from the peer's data position
                self.replicas.start_again()
                trainer._fit_metrics.reset_step()  # what the void forward logged
                iterator = self.train_batches.begin(s.epoch, s.batches_in_epoch)
                ran = self._train_step(iterator, epoch_len, val_every, timed, meter)
            if not ran:
                return True
            self._end_step()
        return False

    def _train_step(
        self, iterator: Any, epoch_len: int | None, val_every: int | None, timed: bool, meter: Throughput
    ) -> bool:
        """The epoch's next optimizer step, its validation and on_train_batch_end; False when the epoch's
        data ran out."""
        trainer, s, val_loader = self.trainer, self.trainer.state, self.val_loader
        remaining = None if epoch_len is None else epoch_len - s.batches_in_epoch
        started = time.perf_counter()
        with trainer.clock.phase("data"):
            window = _take(iterator, trainer.accumulate_grad_batches, remaining)
        if not window:
            if self.replicas is not None:  # a recovery moves the data position: the epoch may go on there
                self.replicas.join()
            return False
        first_idx = s.batches_in_epoch
        trainer._dispatch.begin_step()
        trainer._step_hooks = True
        # an epoch mean logged without batch_size weighs its size
        trainer._fit_metrics.set_batch(window[0])
        try:
            outputs = self._optimizer_step(window, meter, started)
            if len(window) == remaining:  # the epoch's last batch: Lightning steps its scheduler now
                self._step_epoch_scheduler_early(s.epoch + 1)
            if (val_loader is not None and val_every and self._stepped() % val_every == 0) or (
                timed and self.val_timer.due(s.global_step)
            ):
                self._validate()
            trainer._dispatch.step("on_train_batch_end", (outputs, window[0], first_idx))
        finally:
            trainer._step_hooks = False
            trainer._fit_metrics.set_batch(None)
        return True

    # ---- one optimizer step ----------------------------------------------------------------------
    def _optimizer_step(self, window: list[Any], meter: Throughput, started: float) -> dict[str, Any]:
        """Forward+backward every micro-batch of `window`, then clip and step once. The time since
        `started` (the data fetch) is productive unless the update is skipped; what follows (logging,
        validation, checkpoints in batch-end callbacks) is not."""
        trainer, module = self.trainer, self.module
        s, strategy, dispatch, optimizer = (
            trainer.state,
            trainer.strategy,
            trainer._dispatch,
            trainer.optimizer,
        )
        if self.first_train_batch is None:
            self.first_train_batch = window[0]
        # the batch hooks see the first micro-batch on the step's device, as Lightning moves it before
        # on_train_batch_start (the step's own move is then a no-op)
        window[0] = strategy.to_device(window[0])
        dispatch.step("on_train_batch_start", (window[0], s.batches_in_epoch))
        meter.count(window, s)
        out = strategy.train_step(module, window, s.batches_in_epoch)  # forward+backward of the window
        if self.replicas is not None:  # joined at the first backward; else (a pipeline schedule's) now
            self.replicas.join()
        if out is None:  # a training_step returned None (on some rank): no update, as in Lightning
            return self._skip_returned_none(window)
        loss, num_tokens = out.loss, out.num_tokens
        self.step_loss, self.step_norm, self.skip_reason = loss, None, None
        # fault tolerance's groups of one process take a token-weighted loss's gradients as summed
        summed = self.replicas is not None and self.replicas.sums_tokens
        strategy.finish_gradients(module, optimizer, None if summed else num_tokens)
        if self.replicas is not None:  # ...and over the live replica groups, before anything reads them
            self.replicas.average_gradients(module, num_tokens)
        dispatch.step("on_after_backward")
        dispatch.step("on_before_optimizer_step", (optimizer,))  # before clipping, as in Lightning
        log_now, flags = trainer.logs_this_step, trainer.flags
        wants_norm = flags.gradient_clip_val is not None or log_now
        if self.replicas is not None and wants_norm and self.step_norm is None:  # the vote rides its sum
            trained = strategy.trained_parameters(optimizer)
            self.step_norm = self.replicas.norm_with_vote(trained, vote=self.skip_reason is None)
        if flags.gradient_clip_val is not None:  # (a norm a hook asked for is not taken again)
            self.step_norm = strategy.clip_gradients(
                strategy.trained_parameters(optimizer),
                flags.gradient_clip_val,
                flags.gradient_clip_algorithm,
                self.step_norm,
            )
        elif log_now:
            self.step_grad_norm()
        lr = optimizer.param_groups[0]["lr"]
        if self.replicas is not None and not self.replicas.commit(vote=self.skip_reason is None):
            self.skip_reason = self.skip_reason or "fault tolerance: the replica groups discarded the step"
        skipped = self.skip_reason is not None
        with trainer.clock.phase("optimizer"):
            if skipped:
                strategy.precision.skip_step()
            else:  # False: fp16's loss scaler dropped the update for inf/nan gradients
                skipped = not strategy.optimizer_step(optimizer)
            s.skipped_steps += skipped
            dispatch.step("on_before_zero_grad", (optimizer,))
            optimizer.zero_grad(set_to_none=True)
            self.step_scheduler("step", s.global_step + 1)
        strategy.after_optimizer_step()
        if self.replicas is not None:  # DiLoCo's groups meet after a window's last step
            self.replicas.end_step()
        if not skipped:
            s.productive_s += time.perf_counter() - started
        self.losses.record(loss, s.global_step)  # the model as of this step gave a non-finite loss?
        s.global_step += 1
        s.batches_in_epoch += len(window)
        meter.step_done()
        if log_now:  # written now, before batch-end callbacks (a checkpoint, a stop) can interrupt
            step_log.log_train(trainer, loss, num_tokens, lr, self.step_norm, meter)
        else:
            step_log.keep_step_metrics(trainer)
        trainer._fit_metrics.reset_step()
        self.step_logged = log_now
        return {"loss": loss, "skipped": skipped}

    def _before_backward(self, loss: torch.Tensor) -> None:
        """Before each backward of a step: fault tolerance's quorum joined (at the first, after the forward
        it overlapped), then the on_before_backward hooks."""
        if self.replicas is not None:
            self.replicas.join()
        self.trainer._dispatch.step("on_before_backward", (loss,))

    def _stepped(self) -> int:
        """The count `val_check_interval` (an int) is in: optimizer steps (manual optimization: batches)."""
        return self.trainer.state.global_step

    def _skip_returned_none(self, window: list[Any]) -> dict[str, Any]:
        """training_step returned None: the step counts (as in Lightning, where the optimizer is still
        called with no gradients) but updates nothing; what the window accumulated is dropped."""
        trainer = self.trainer
        s = trainer.state
        trainer.say_once(
            "training_step returned None",
            f"training_step returned None at step {s.global_step + 1}: that optimizer step is skipped on "
            "every rank (said once per run)",
        )
        trainer.optimizer.zero_grad(set_to_none=True)
        s.global_step += 1
        s.skipped_steps += 1
        s.batches_in_epoch += len(window)
        self.step_scheduler("step", s.global_step)
        trainer._fit_metrics.reset_step()
        return {"loss": None, "skipped": True}

    def _end_step(self) -> None:
        """After on_train_batch_end: what it logged per step belongs to the step that just ended (as in
        Lightning), so it is logged at that step when the step was (else kept for callback_metrics and
        logged_metrics, as the step's own values were); then the step's metrics clear."""
        self._take_step_values()
        self.step_logged = False
        if self.progress is not None:
            self.progress.update()
        self.step_loss = self.step_norm = None

    def _take_step_values(self) -> None:
        """What was logged per step since the last take: logged at this step when it writes a row
        (`step_logged`), else kept for callback_metrics and logged_metrics; then cleared."""
        trainer = self.trainer
        buffer = trainer._fit_metrics
        if not buffer.has_step_values():  # (most steps of a module that logs nothing per step)
            return
        if self.step_logged:
            extra = buffer.compute_step(trainer._reduce_logged)
            if extra:
                trainer.log_metrics(extra, hidden=buffer.not_for_loggers())
        else:
            step_log.keep_step_metrics(trainer)
        buffer.reset_step()

    # ---- what the Trainer's control methods reach ------------------------------------------------
    def step_grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the step's gradients (before clipping), computed once per step."""
        if self.step_norm is None:
            strategy = self.trainer.strategy
            self.step_norm = strategy.grad_norm(strategy.trained_parameters(self.trainer.optimizer))
        return self.step_norm

    # ---- optimizer and schedule ------------------------------------------------------------------
    def setup_optimizer(self) -> None:
        """The module's optimizer (fused where it can be) and either its own scheduler or the Trainer's."""
        trainer = self.trainer
        optimizer, trainer._scheduler_config = parse_optimizers(self.module.configure_optimizers())
        trainer.optimizer = trainer.strategy.setup_optimizer(prefer_fused(optimizer))
        if trainer._scheduler_config is not None:
            if trainer.lr_schedule != "constant" or trainer.warmup_steps:
                raise ValueError(
                    f"configure_optimizers returned its own lr_scheduler and the Trainer has lr_schedule={trainer.lr_schedule!r}, "
                    f"warmup_steps={trainer.warmup_steps}; allowed: one of the two (leave the Trainer's at 'constant', 0)"
                )
            trainer.lr_scheduler = trainer._scheduler_config.scheduler
            return
        total = self.total_steps()
        if trainer.lr_schedule != "constant" and total is None:
            raise ValueError(
                f"lr_schedule={trainer.lr_schedule!r} needs the run length: set max_steps, or use a loader with len()"
            )
        trainer._schedule = LRSchedule(
            trainer.lr_schedule, trainer.warmup_steps, total or 1, trainer.min_lr_ratio
        )
        trainer.lr_scheduler = build_scheduler(trainer.optimizer, trainer._schedule)

    def step_scheduler(self, interval: str, count: int) -> None:
        """The Trainer's own schedule steps every optimizer step; a module's scheduler at its interval."""
        trainer = self.trainer
        config = trainer._scheduler_config
        if config is None:
            if interval == "step":
                trainer.lr_scheduler.step()
        elif config.interval == interval:
            # a scheduler without a monitor reads no metric: not reading them keeps this step off the host
            config.step(count, trainer.callback_metrics if config.needs_metric else {})

    def _step_epoch_scheduler_early(self, epochs_done: int) -> None:
        """In the epoch's last batch, before its on_train_batch_end and the epoch-end validation, as Lightning:
        a module's epoch-interval scheduler without a monitor (ReduceLROnPlateau waits for the validation)."""
        config = self.trainer._scheduler_config
        if config is not None and config.interval == "epoch" and not config.needs_metric:
            config.step(epochs_done, {})
            self.epoch_scheduler_stepped = True

    def total_steps(self) -> int | None:
        """Optimizer steps the fit will take, if knowable."""
        trainer, per_epoch = self.trainer, None
        length = self.train_batches.epoch_length()
        if length is not None:
            per_epoch = math.ceil(length / trainer.accumulate_grad_batches)
        by_epochs = per_epoch * trainer.max_epochs if per_epoch is not None and trainer.max_epochs else None
        candidates = [n for n in (trainer.max_steps, by_epochs) if n is not None]
        return min(candidates) if candidates else None

    def _val_every_n_steps(self, epoch_len: int | None) -> int | None:
        """Steps between validations; None = at the end of each epoch."""
        interval = self.trainer.val_check_interval
        if interval is None or self.val_timer is not None:  # (a time: `val_timer`)
            return None
        if isinstance(interval, int):
            return interval
        if epoch_len is None:
            raise ValueError(
                f"val_check_interval={interval} is a fraction of an epoch but the loader has no len(); pass an int"
            )
        return max(1, round(interval * math.ceil(epoch_len / self.trainer.accumulate_grad_batches)))

    def _current_val_loader(self) -> Iterable:
        """The val loader, read again first when reload_dataloaders_every_n_epochs says it is due."""
        self.val_loader = self.reload.val(self.val_loader, self.trainer.current_epoch)
        return self.val_loader

    def _validate(self) -> None:
        self.module.on_validation_model_zero_grad()  # (always between optimizer steps here)
        eval_loop.validate_in_fit(self.trainer, self.module, self._current_val_loader())
        if self.val_timer is not None:  # the next is due that long after this one ended, as in Lightning
            self.val_timer.restart(self.trainer.global_step)

    def _val_at_start_due(self) -> bool:
        return self.trainer.val_at_start and self.trainer.state.global_step == 0


def effective_training_time(state: LoopState) -> dict[str, float]:
    """Productive step seconds over wall-clock seconds since the run first started."""
    wall = max(time.time() - state.started_at, 1e-9)
    return {
        "fraction": min(state.productive_s / wall, 1.0),
        "productive_s": state.productive_s,
        "wall_s": wall,
    }


def _take(iterator: Any, k: int, remaining: int | None) -> list[Any]:
    """Up to k next batches (fewer at the end of the epoch or of `remaining`)."""
    return list(itertools.islice(iterator, k if remaining is None else max(0, min(k, remaining))))
