"""RichModelSummary: ModelSummary's table drawn by `rich` (Lightning's)."""

from __future__ import annotations

import importlib.util
from typing import Any

from callbacks.model_summary import ModelSummary
from callbacks.summary_table import human_count


class RichModelSummary(ModelSummary):
    """ModelSummary's rows and totals as a `rich` table on rich's console; `header_style` (a summarize
    keyword, default "bold magenta") styles its header. Needs the `rich` package."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if importlib.util.find_spec("rich") is None:
            raise ModuleNotFoundError(
                "RichModelSummary needs the `rich` package; install it: pip install -U rich"
            )
        super().__init__(max_depth, **summarize_kwargs)

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
        """Print the table and the totals on rich's console."""
        from rich import get_console
        from rich.table import Table

        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for header, _ in summary_data:
            if header == " ":
                table.add_column(" ", style="dim")
            elif header in ("Params", "FLOPs", "In sizes", "Out sizes"):
                table.add_column(header, justify="right", style="white" if "sizes" in header else None)
            else:
                table.add_column(header, justify="left", no_wrap=header == "Name")
        for row in zip(*(cells for _, cells in summary_data), strict=True):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        frozen = total_parameters - trainable_parameters
        for label, value in (
            ("Trainable params", human_count(trainable_parameters).ljust(10)),
            ("Non-trainable params", human_count(frozen).ljust(10)),
            ("Total params", human_count(total_parameters).ljust(10)),
            ("Total estimated model params size (MB)", f"{model_size:,.3f}".ljust(10)),
            ("Modules in train mode", total_training_modes["train"]),
            ("Modules in eval mode", total_training_modes["eval"]),
            ("Total FLOPs", human_count(total_flops)),
        ):
            grid.add_row(f"[bold]{label}[/]: {value}")
        console.print(grid)
