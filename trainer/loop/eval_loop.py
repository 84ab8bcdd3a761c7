"""The one evaluation loop: a module's `validation_step`, `test_step` or `predict_step` over a loader,
inside Lightning's hooks, without gradients, on its own RNG (evaluating never changes the training
trajectory) and with its own metrics buffer (what it logs never mixes with a fit's aggregates). The
sanity check, validation inside a fit, `validate`, `test` and `predict` are this loop with their own
framing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from strategies.base import unpack_loss
from trainer.core.dtensors import is_dtensor
from trainer.core.metrics import MetricBuffer, kept_metric_states
from trainer.core.rng import isolated_rng
from trainer.data.loader import several_loaders
from trainer.loop import step_log
from trainer.loop.epochs import EpochBatches
from trainer.module import TrainModule

if TYPE_CHECKING:
    from trainer.trainer import Trainer

# a loop's step method, the prefix of the mean loss it reports, and the flag that limits its batches
_STEP = {"validation": "validation_step", "test": "test_step", "predict": "predict_step"}
_PREFIX = {"validation": "val", "test": "test"}
_LIMIT = {"validation": "limit_val_batches", "test": "limit_test_batches", "predict": "limit_predict_batches"}


@contextlib.contextmanager
def metrics_buffer(trainer: Trainer, buffer: MetricBuffer) -> Iterator[MetricBuffer]:
    """Route what `TrainModule.log` records to `buffer` while inside; the one outside comes back after."""
    outside = trainer._eval_metrics
    trainer._eval_metrics = buffer
    try:
        yield buffer
    finally:
        trainer._eval_metrics = outside


def evaluate(
    trainer: Trainer,
    module: TrainModule,
    loader: Iterable,
    stage: str,
    limit: Any,
    report: Callable[[dict[str, float], set[str], set[str]], None] | None = None,
    log_step: Callable[[dict[str, float], set[str]], None] | None = None,
    cap: int | None = None,
) -> tuple[dict[str, float], set[str], list[Any]]:
    """`stage`'s loop ("validation", "test", "predict") over at most `limit` (and `cap`) batches of `loader`
    (of each, one after the other, for a list of loaders), in eval mode from `on_<stage>_start` to
    `on_<stage>_end`: the returned loss's mean over the examples (tokens, with num_tokens) of every rank, what
    the step logged (aggregated as it asked), the names logged with logger=False, and every step's output.
    `report(metrics, hidden, prog_bar)` (the names logged with prog_bar=True) runs before
    `on_<stage>_end`, so that its callbacks read them; `log_step(metrics, hidden)` after each batch's
    `on_<stage>_batch_end`, with what it logged `on_step`."""
    dispatch, strategy, method = trainer._dispatch, trainer.strategy, _STEP[stage]
    sources = list(loader) if several_loaders(loader) else [loader]
    if stage == "predict" and len(sources) > 1:
        raise ValueError(
            f"predict got {len(sources)} dataloaders; allowed: one (call predict once per dataloader)"
        )
    lengths = [EpochBatches(one, limit, _LIMIT[stage]).epoch_length() for one in sources]
    lengths = [n if cap is None else cap if n is None else min(n, cap) for n in lengths]
    several = len(sources) > 1  # Lightning: a list of one loader is that loader (no dataloader_idx)
    outputs: list[Any] = []  # predict's; the others keep only each step's loss and its weight
    losses: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []
    # what prediction writers read: the outputs so far and each batch's dataset indices
    record = trainer.predict_loop if stage == "predict" else None
    if record is not None:
        sources = [record.start(sources[0], outputs)]
    with _eval_mode(module, stage):
        dispatch.all(f"on_{stage}_start")
        with metrics_buffer(trainer, MetricBuffer()) as buffer:
            trainer.evaluating = True
            try:
                dispatch.all(f"on_{stage}_epoch_start")
                with isolated_rng(), _without_grad(trainer, module):
                    for dataloader_idx, (source, n_batches) in enumerate(zip(sources, lengths, strict=True)):
                        # as Lightning: the step, the batch hooks and `log` get the index with several loaders
                        extra = (dataloader_idx,) if several else ()
                        trainer.eval_loader_idx = dataloader_idx if several else None
                        for idx, batch in enumerate(source):
                            if n_batches is not None and idx >= n_batches:
                                break
                            batch = strategy.batch_to_device(batch)
                            if record is not None:
                                record.batch(idx)
                            buffer.set_batch(batch)  # an epoch mean logged without batch_size weighs its size
                            dispatch.all(f"on_{stage}_batch_start", batch, idx, *extra)
                            output = strategy.eval_step(module, method, batch, idx, *extra)
                            dispatch.all(f"on_{stage}_batch_end", output, batch, idx, *extra)
                            buffer.set_batch(None)
                            if log_step is not None:
                                log_step(
                                    buffer.compute_step(trainer._reduce_logged), buffer.not_for_loggers()
                                )
                            buffer.reset_step()
                            if stage == "predict":
                                outputs.append(output)
                            elif output is not None:
                                loss, num_tokens = unpack_loss(output, method)
                                losses.append(loss.float())
                                weights.append(_weight(num_tokens, batch, loss.device))
                        trainer.eval_loader_idx = None
                    dispatch.all(f"on_{stage}_epoch_end")  # what it logs belongs to this loop
                metrics = {} if stage == "predict" else buffer.compute_epoch(trainer._reduce_logged)
                hidden, prog_bar = buffer.not_for_loggers(), set(buffer.prog_bar_names)
                buffer.reset()  # the loop's torchmetrics Metrics start the next loop empty, as in Lightning
            finally:
                trainer.evaluating = False
                trainer.eval_loader_idx = None
        if losses:  # weighted by examples (tokens when the step returns num_tokens), as HF and Lightning
            weight = torch.stack(weights)
            total = strategy.reduce(
                torch.stack([(torch.stack(losses) * weight).sum(), weight.sum()]), "sum", group="loss"
            )
            metrics[f"{_PREFIX[stage]}/loss"] = float(total[0] / total[1])
        if report is not None:
            report(metrics, hidden, prog_bar)
        dispatch.all(f"on_{stage}_end")
    return metrics, hidden, outputs


def _without_grad(trainer: Trainer, module: TrainModule) -> contextlib.AbstractContextManager:
    """Lightning's rule: validate/test/predict under `torch.inference_mode` with `inference_mode=True` (their
    tensors can never join a graph), a fit's validation under `no_grad`. Under several processes or sharded
    (DTensor) parameters, `no_grad` too: Lightning takes it on gloo and FSDP, and torch's collectives,
    DTensors and pipelining are not tested under inference mode here."""
    alone = trainer.strategy.world_size == 1 and not any(is_dtensor(p) for p in module.parameters())
    return (
        torch.inference_mode()
        if trainer.inference_mode and not trainer.fitting and alone
        else torch.no_grad()
    )


def _weight(num_tokens: torch.Tensor | None, batch: Any, device: torch.device) -> torch.Tensor:
    """What a step's loss is a mean over: its tokens when it says so, else the batch's examples."""
    if num_tokens is not None:
        return num_tokens.float().reshape(())
    return torch.tensor(float(step_log.batch_size(batch)[0]), device=device)


def validate_in_fit(trainer: Trainer, module: TrainModule, loader: Iterable) -> dict[str, float]:
    """A validation inside a fit: its metrics go to the loggers at the current step, each batch's `on_step`
    values (Lightning's rows) at the count of the fit's validation batches before it."""
    loop = trainer._fit_loop

    def log_step(metrics: dict[str, float], hidden: set[str]) -> None:
        step_log.log_eval_step(trainer, metrics, hidden, loop.val_batches_seen)
        loop.val_batches_seen += 1

    def report(metrics: dict[str, float], hidden: set[str], prog_bar: set[str]) -> None:
        step_log.log_metrics(trainer, metrics, hidden, own={"val/loss"})  # the returned loss: ours
        loop.last_val_step = trainer.global_step
        step_log.show_validation(trainer, metrics, prog_bar)

    return evaluate(trainer, module, loader, "validation", trainer.limit_val_batches, report, log_step)[0]


def evaluate_alone(
    trainer: Trainer, module: TrainModule, loader: Iterable, stage: str, limit: Any
) -> dict[str, float]:
    """`validate`/`test` outside a fit: what they log fills `callback_metrics` and `logged_metrics` as
    Lightning's do (both emptied first, as every Lightning stage starts): each batch's `on_step` values
    into `logged_metrics`, the epoch's values into both (`logger=False` ones into `callback_metrics` only)."""
    step_log.reset_metrics(trainer)

    def log_step(metrics: dict[str, float], hidden: set[str]) -> None:
        trainer.logged_metrics.update({k: v for k, v in metrics.items() if k not in hidden})

    def report(metrics: dict[str, float], hidden: set[str], prog_bar: set[str]) -> None:
        step_log.note_metrics(trainer, metrics)
        log_step(metrics, hidden)

    return evaluate(trainer, module, loader, stage, limit, report, log_step)[0]


def sanity_check(trainer: Trainer, module: TrainModule, loader: Iterable) -> None:
    """Lightning's sanity check: the first `num_sanity_val_steps` validation batches (-1: all) run
    before training so that a broken `validation_step` fails now, not after an epoch; nothing it
    logs is kept, and it draws no random numbers from the run's generators."""
    n = trainer.num_sanity_val_steps
    trainer.sanity_checking = True
    try:
        trainer._dispatch.callbacks("on_sanity_check_start")
        evaluate(trainer, module, loader, "validation", trainer.limit_val_batches, cap=None if n == -1 else n)
        trainer._dispatch.callbacks("on_sanity_check_end")
    finally:
        trainer.sanity_checking = False


def loss_on(trainer: Trainer, batch: Any) -> torch.Tensor | None:
    """`Trainer.loss_on`: this rank's `validation_step` loss on `batch`, free of side effects."""
    module = trainer.module
    if type(module).validation_step is TrainModule.validation_step:
        raise TypeError(
            f"loss_on needs {type(module).__name__}.validation_step, which is not defined; "
            "allowed: a module that overrides validation_step"
        )
    was_training = module.training
    module.eval()
    # what the step logs goes to a buffer that is dropped, leaving a step's pending metrics untouched, and
    # torchmetrics Metrics it updates get their states back
    try:
        with (
            metrics_buffer(trainer, MetricBuffer()),
            kept_metric_states(module),
            isolated_rng(),
            torch.no_grad(),
        ):
            output = trainer.strategy.eval_step(
                module, "validation_step", trainer.strategy.batch_to_device(batch), 0
            )
        return None if output is None else unpack_loss(output, "validation_step")[0].float()
    finally:
        module.train(was_training)


@contextlib.contextmanager
def _eval_mode(module: TrainModule, stage: str) -> Iterator[None]:
    """Lightning's `on_<stage>_model_eval` around a whole loop (its start and end hooks included),
    then `on_<stage>_model_train` if the module was training (predict, which Lightning gives no such
    hook, puts the module's mode back)."""
    was_training = module.training
    getattr(module, f"on_{stage}_model_eval")()
    try:
        yield
    finally:
        if stage == "predict":
            module.train(was_training)
        elif was_training:
            getattr(module, f"on_{stage}_model_train")()
