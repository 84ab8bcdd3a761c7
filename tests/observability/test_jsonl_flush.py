"""The JSONL log's rows reach its file within a second of being logged, and before each checkpoint: a run
killed at once keeps every row up to its last checkpoint, from which its resume logs the rest again."""

import json

from helpers import Regression, regression_loader

from callbacks import Callback
from trainer import Trainer
from trainer.loggers import jsonl
from trainer.loggers.base import LoggerRun


def rows_on_disk(path) -> list[int]:
    """The steps of the rows the file holds now (what a reader, or a killed run, finds)."""
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_rows_reach_the_file_once_a_second_has_passed(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(jsonl.time, "monotonic", lambda: now[0])
    logger = jsonl.JSONLLogger()
    logger.setup(LoggerRun(tmp_path, "run", None, folder_locks=None))
    for step in (1, 2, 3):
        logger.log_metrics({"train/loss": 0.5}, step)
    now[0] += jsonl.FLUSH_EVERY_S
    logger.log_metrics({"train/loss": 0.4}, 4)
    assert rows_on_disk(logger.path) == [1, 2, 3, 4]
    logger.finalize()


class ReadsTheLogAfterEachCheckpoint(Callback):
    """Saves a checkpoint every other step and reads the log file from disk right after it."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int]]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % 2 == 0:
            trainer.save_checkpoint()
            self.seen.append((trainer.global_step, rows_on_disk(trainer.loggers[0].path)))


def test_every_row_logged_before_a_checkpoint_is_in_the_file_when_it_is_written(tmp_path, monkeypatch):
    # no flush by time in this test: only the checkpoints put the rows on disk
    monkeypatch.setattr(jsonl, "FLUSH_EVERY_S", float("inf"))
    reader = ReadsTheLogAfterEachCheckpoint()
    trainer = Trainer(
        max_steps=6,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[reader],
        default_root_dir=tmp_path,
    )
    trainer.fit(Regression(), regression_loader())
    assert reader.seen == [(2, [1, 2]), (4, [1, 2, 3, 4]), (6, [1, 2, 3, 4, 5, 6])]
