"""What a fit tells the loggers and the console: the loggers' start, the step's row, rates, the
validation line, the start-up line and the effective-training-time line. Functions of the trainer; rank
zero writes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.checkpoint import run_folder
from trainer.core.logging import rank_zero_info
from trainer.core.metrics import UnreadStepValues, with_bare_names
from trainer.loggers.base import LoggerRun, plain
from trainer.loop.progress import fmt

if TYPE_CHECKING:
    from trainer.loop.state import LoopState
    from trainer.module import TrainModule
    from trainer.trainer import Trainer

# the Trainer's flags that go into the loggers' hyperparameters, next to the run's shape
_LOGGED_FLAGS = (
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


def log_metrics(
    trainer: Trainer, metrics: dict[str, float], hidden: set[str] = frozenset(), own: set[str] = frozenset()
) -> None:
    """Send `metrics` to every logger at the current step, except the `hidden` names, and the Trainer's
    `own` ones (train/loss, rates, a returned val/loss) only to loggers that take them (not Lightning's
    CSV); all of them reach `callback_metrics`, a `name_step`/`name_epoch` pair also under `name`."""
    note_metrics(trainer, metrics)
    logged = {k: v for k, v in metrics.items() if k not in hidden}
    trainer.logged_metrics.update(logged)
    if trainer.is_global_zero and logged:
        epoch = {"epoch": logged.get("epoch", trainer.current_epoch)}  # every row names it, as Lightning's
        users = None  # made when a logger takes only the module's
        for lg in trainer.loggers:
            if lg.trainer_metrics:
                row = logged
            else:
                row = users = {k: v for k, v in logged.items() if k not in own} if users is None else users
            if row.keys() - {"epoch"}:
                lg.log_metrics({**row, **epoch}, trainer.global_step)


def note_metrics(trainer: Trainer, metrics: dict[str, float]) -> None:
    """`metrics` into `callback_metrics`, a `name_step`/`name_epoch` pair also under `name` (its latest value)."""
    trainer.callback_metrics.update(with_bare_names(metrics))


def reset_metrics(trainer: Trainer) -> None:
    """Empty `callback_metrics` and `logged_metrics` (the values not yet read included), as a Lightning stage
    starts."""
    trainer._callback_metrics.clear()
    trainer._logged_metrics.clear()
    trainer._unread_steps = UnreadStepValues()


def keep_step_metrics(trainer: Trainer) -> None:
    """A step that writes no row (`log_every_n_steps`): what the module logged per step still reaches
    `callback_metrics` and `logged_metrics`, as in Lightning, where both hold each step's values whatever
    the loggers get; they are read from the device when one of them is (`UnreadStepValues`)."""
    buffer = trainer._fit_metrics
    if buffer.has_step_values():  # (most steps of a module that logs nothing per step: nothing to keep)
        trainer._unread_steps.add(buffer.step_values(trainer._reduce_logged), buffer.not_for_loggers())


def log_eval_step(trainer: Trainer, metrics: dict[str, float], hidden: set[str], step: int) -> None:
    """A validation batch's `on_step=True` values (`name_step`), as Lightning logs them: to the loggers at
    `step` (the fit's validation batches before this one) without an epoch, and into `logged_metrics`, not
    into `callback_metrics` (which keep the epoch's values)."""
    logged = {k: v for k, v in metrics.items() if k not in hidden}
    trainer.logged_metrics.update(logged)
    if trainer.is_global_zero and logged:
        for lg in trainer.loggers:
            lg.log_metrics(logged, step)


def start_loggers(trainer: Trainer, module: TrainModule, resumed: bool) -> None:
    """At fit start: rank zero sets up every logger (each versioned one claims its `version_N` folder)
    and gives it the module's hyperparameters (merged with the datamodule's, as Lightning) and the run's
    record; the other ranks adopt what it chose (the versions, so `log_dir` reads the same), or its error."""
    run = LoggerRun(
        Path(trainer.default_root_dir),
        trainer.run_id,
        trainer.global_step if resumed else None,
        folder_locks=run_folder,
        checkpoint_dir=trainer.checkpoint_manager.claimed,
    )
    outcome: Any = None
    error: Exception | None = None
    if trainer.is_global_zero:
        try:
            for lg in trainer.loggers:
                lg.setup(run)
            outcome = [lg.shared() for lg in trainer.loggers]
        except (run_folder.FolderInUse, ValueError, OSError) as err:
            error, outcome = err, (isinstance(err, run_folder.FolderInUse), str(err))
    outcome = trainer.strategy.broadcast_object(outcome)
    if error is not None:
        raise error
    if isinstance(outcome, tuple):  # the other ranks fail with rank zero's one line
        raise (run_folder.FolderInUse if outcome[0] else ValueError)(outcome[1])
    if not trainer.is_global_zero:
        for lg, shared in zip(trainer.loggers, outcome, strict=True):
            lg.adopt(shared)
        return
    params = plain({**dict(getattr(trainer.datamodule, "hparams", None) or {}), **dict(module.hparams)})
    record = hyperparams(trainer, module)
    for lg in trainer.loggers:
        if trainer.enable_autolog_hparams:
            lg.log_hyperparams(params)
        lg.log_run(record)


def show_validation(trainer: Trainer, metrics: dict[str, float], prog_bar: set[str]) -> None:
    """After a validation inside a fit, on rank zero's bar: a line with what it logged, and its
    `prog_bar=True` values kept on the bar until the next validation."""
    progress = trainer._fit_loop.progress
    if progress is None or not metrics:
        return
    values = ", ".join(f"{k}={fmt(v)}" for k, v in metrics.items())
    progress.write(f"validation at step {trainer.global_step} (epoch {trainer.current_epoch}): {values}")
    progress.keep({k: v for k, v in metrics.items() if k in prog_bar})


def log_train(
    trainer: Trainer,
    loss: torch.Tensor,
    num_tokens: torch.Tensor | None,
    lr: float,
    norm: Any,
    meter: Throughput,
) -> None:
    """The step's row: loss, learning rate, grad norm, rates, and what the step logged per step."""
    strategy, buffer = trainer.strategy, trainer._fit_metrics
    if num_tokens is not None:  # token-weighted mean over ranks
        total = strategy.reduce(torch.stack([loss * num_tokens, num_tokens]), "sum", group="loss")
        loss = total[0] / total[1]
    else:
        loss = strategy.reduce(loss, "mean", group="loss")
    metrics = {"train/loss": float(loss), "train/lr": lr, "epoch": trainer.state.epoch}
    if norm is not None:
        metrics["train/grad_norm"] = float(norm)
    metrics.update(meter.rates(strategy.dp_size))
    metrics.update(strategy.step_metrics())
    metrics["train/effective_time"] = trainer.effective_training_time()["fraction"]
    if trainer.state.skipped_steps:
        metrics["train/skipped_steps"] = trainer.state.skipped_steps
    user = buffer.compute_step(trainer._reduce_logged) if buffer.has_step_values() else {}
    own = set(metrics) - {"epoch"}
    metrics.update(user)
    log_metrics(trainer, metrics, buffer.not_for_loggers(), own - set(user))
    progress = trainer._fit_loop.progress
    if progress is not None:  # rank zero's
        shown = {"loss": metrics["train/loss"], "lr": lr}
        if "train/tokens_per_s" in metrics:
            shown["tok/s"] = metrics["train/tokens_per_s"]
        shown.update({k: v for k, v in user.items() if k in buffer.prog_bar_names})
        progress.show(shown)


def log_epoch_metrics(trainer: Trainer) -> None:
    """What training steps logged with on_epoch=True, aggregated over the epoch, then reset."""
    buffer = trainer._fit_metrics
    metrics = buffer.compute_epoch(trainer._reduce_logged)
    if metrics:
        log_metrics(trainer, metrics, hidden=buffer.not_for_loggers())
    buffer.reset()


def effective_time_line(trainer: Trainer) -> str:
    """The line a fit ends with: how much of the run's wall-clock time went into kept steps."""
    t, state = trainer.effective_training_time(), trainer.state
    return (
        f"effective training time {100 * t['fraction']:.1f}%: {t['productive_s']:.1f} s in kept steps of "
        f"{t['wall_s']:.1f} s since the run started ({state.restarts} restart(s)/rollback(s), "
        f"{state.skipped_steps} skipped step(s))"
    )


def announce(trainer: Trainer, module: TrainModule) -> None:
    """One line on what is about to run: size, parallelism, precision and the global batch."""
    strategy, accumulate = trainer.strategy, trainer.accumulate_grad_batches
    # a pipeline stage holds some of the blocks: the model's size is the sum over the stages
    # a module may count its own parameters only, as PEFT does (HFModule: not DPO's frozen reference)
    params = list(getattr(module, "counted_parameters", module.parameters)())
    local = [sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)]
    counts = strategy.reduce(
        torch.tensor(local, dtype=torch.float64, device=strategy.root_device), "sum", group="pp"
    )
    trainable, total = counts.tolist()
    batch = getattr(trainer._fit_loop.train_batches.loader, "batch_size", None)
    line = (  # the counts as PEFT's print_trainable_parameters gives them
        f"{trainer._module_name}: trainable params: {trainable:,.0f} || all params: {total:,.0f} || "
        f"trainable%: {100 * trainable / max(total, 1):.4f} | strategy {strategy.name}, "
        f"{strategy.world_size} process(es), precision {strategy.precision.name}"
    )
    if isinstance(batch, int):
        line += (
            f" | global batch = {batch} per micro-batch x {accumulate} accumulated x "
            f"{strategy.dp_size} data-parallel = {batch * accumulate * strategy.dp_size} samples/step"
        )
    rank_zero_info(line)
    report = strategy.startup_report(module)
    if report:
        rank_zero_info(report)


def hyperparams(trainer: Trainer, module: TrainModule) -> dict[str, Any]:
    """What the loggers record as the run's hyperparameters: the Trainer's flags, the run's shape and the
    module's own `hparams`."""
    strategy = trainer.strategy
    params = {k: getattr(trainer, k) for k in _LOGGED_FLAGS}
    params.update(
        strategy=strategy.name,
        precision=strategy.precision.name,
        world_size=strategy.world_size,
        module=trainer._module_name,
        parameters=sum(p.numel() for p in module.parameters()),
    )
    if module.hparams:
        params["hparams"] = plain(dict(module.hparams))
    return params


class Throughput:
    """Samples and tokens consumed since the last logged step, turned into per-second rates."""

    def __init__(self) -> None:
        self.samples = self.tokens = self.steps = 0
        self.has_tokens = True
        self.since = time.perf_counter()

    def count(self, window: list[Any], state: LoopState) -> None:
        """Count a step's micro-batches, here (for the rates) and in the loop's checkpointed counters."""
        for batch in window:
            samples, tokens = batch_size(batch)
            self.samples += samples
            state.samples_seen += samples
            if tokens is None:
                self.has_tokens = False
            else:
                self.tokens += tokens
                state.tokens_seen += tokens

    def step_done(self) -> None:
        """One more optimizer step in the current window."""
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


def batch_size(batch: Any) -> tuple[int, int | None]:
    """(samples, tokens) of a batch: tokens are counted when it carries `input_ids` (a dict key, or a 2-D
    integer tensor as the batch or its first element)."""
    if isinstance(batch, dict):
        ids = batch.get("input_ids")
        first = (
            ids if ids is not None else next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        )
    else:
        first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
        ids = (
            first
            if isinstance(first, torch.Tensor) and first.ndim == 2 and not first.is_floating_point()
            else None
        )
    samples = first.shape[0] if isinstance(first, torch.Tensor) and first.ndim else 1
    return samples, (ids.numel() if isinstance(ids, torch.Tensor) else None)
