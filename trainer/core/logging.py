"""The console: the framework's `logging` logger, rank-aware (rank zero prints info lines, the others
warnings and errors with their rank), written above the progress bar. The loggers are in trainer.loggers."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only
from tqdm import tqdm

log = logging.getLogger("trainer")


def set_rank(rank: int) -> None:
    """Tell the rank-zero helpers (lightning-utilities' `rank_zero_only.rank`) and the console which rank
    this process is."""
    rank_zero_only.rank = rank
    _style_console()


@rank_zero_only
def rank_zero_info(message: str) -> None:
    """An info line, from rank zero only."""
    log.info(message)


def configure_console_logging() -> None:
    """Show the framework's info lines on stderr unless the application configured logging itself."""
    if not log.handlers and not logging.getLogger().handlers:
        log.addHandler(_AboveTheBar(sys.stderr))
        log.propagate = False
    _style_console()


def _style_console() -> None:
    """Rank zero prints info lines; other ranks print only warnings and errors, prefixed with their rank."""
    rank = rank_zero_only.rank
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    prefix = "[trainer]" if rank == 0 else f"[trainer rank {rank}]"
    for handler in log.handlers:
        handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))


set_rank(int(os.environ.get("RANK", 0)))  # until the strategy knows the process group


def console_write(line: str, end: str = "\n", file: Any = None) -> None:
    """Print `line` (on `file`, default stderr) above any progress bar: tqdm clears the bar, prints, then
    redraws it, so no line is drawn over the bar and no fragment of the bar is left in front of it."""
    tqdm.write(line, file=file or sys.stderr, end=end)


class _AboveTheBar(logging.StreamHandler):
    """The console handler: each record through tqdm's `write`, above a progress bar in flight."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise into the run (StreamHandler's rule)
            self.handleError(record)
