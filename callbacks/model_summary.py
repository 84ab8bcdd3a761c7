"""ModelSummary: the table of the module's layers at the start of a fit (Lightning's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from callbacks.summary_table import Summary, check_max_depth, format_table, summarize
from trainer.core.logging import log

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class ModelSummary(Callback):
    """At fit start, rank zero prints the table of the module's layers down to `max_depth` (1: its children;
    -1: every module; 0: no table): name, type, parameters, train/eval mode, FLOPs and, with an
    `example_input_array` on the module, each layer's input and output sizes; then the totals. Override the
    static `summarize` to show it otherwise (`summarize_kwargs` are passed to it)."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        self._max_depth = check_max_depth(max_depth)
        self._summarize_kwargs = summarize_kwargs

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not self._max_depth:
            return
        # every rank measures (the example forward may be a collective under a sharded strategy); rank zero shows
        summary = summarize(module, self._max_depth, trainer.precision, trainer.strategy.batch_to_device)
        if trainer.is_global_zero:
            self.summarize(
                summary.columns,
                summary.total_parameters,
                summary.trainable_parameters,
                summary.model_size,
                summary.total_training_modes,
                total_flops=summary.total_flops,
                **self._summarize_kwargs,
            )

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        """Show the table (Lightning's signature): `summary_data` is its columns as (header, cells)."""
        summary = Summary(
            summary_data,
            total_parameters,
            trainable_parameters,
            model_size,
            total_training_modes,
            total_flops,
        )
        log.info("\n" + format_table(summary))
