"""Lightning's ModelSummary, RichModelSummary, TQDMProgressBar, RichProgressBar and DeviceStatsMonitor run under
PyTorch Lightning and here on the same module (tests/lightning_twins.py): the summary's text (rows, sizes,
FLOPs, totals), where the bar moves for a refresh rate, the device stats' keys and rows; Lightning's error
cases fail here too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import pytorch_lightning.callbacks as lit_callbacks
import pytorch_lightning.callbacks.progress.tqdm_progress as lit_tqdm_progress
import torch
from lightning_twins import loader, logged, nets, trainers
from torch import nn

import callbacks
import trainer.loop.progress as our_progress
from trainer import Trainer, TrainModule
from trainer.loggers.base import Logger


# ---- ModelSummary and RichModelSummary -----------------------------------------------------------------
def layered(base: type) -> type:
    """Nested layers, a layer in eval mode, a parameter of the root's own and an example input."""

    class Layered(base):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(
                nn.Linear(8, 32), nn.Tanh(), nn.Sequential(nn.Linear(32, 32), nn.ReLU())
            )
            self.drop = nn.Dropout(0.1)
            self.drop.eval()
            self.head = nn.Linear(32, 1)
            self.scale = nn.Parameter(torch.ones(1))
            self.example_input_array = torch.zeros(4, 8)

        def forward(self, x):
            return self.head(self.drop(self.encoder(x))) * self.scale

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    Layered.__name__ = Layered.__qualname__ = "Layered"
    return Layered


def summaries(max_depth: int, lit_class: type, our_class: type) -> tuple[list[str], list[str]]:
    torch.manual_seed(0)
    lit, ours = layered(pl.LightningModule)(), layered(TrainModule)()
    lit_trainer, our_trainer = trainers(
        Path("."), [lit_class(max_depth=max_depth)], [our_class(max_depth=max_depth)], max_steps=1
    )
    with logged("pytorch_lightning.callbacks.model_summary") as lit_lines:
        lit_trainer.fit(lit, loader())
    with logged("trainer") as logged_lines:
        our_trainer.fit(ours, loader())
    our_lines = [line for line in logged_lines if "Trainable params" in line]
    return lit_lines, our_lines


@pytest.mark.parametrize("max_depth", [1, 2, -1, 0])
def test_model_summary_prints_lightnings_table(max_depth):
    lit_lines, our_lines = summaries(max_depth, lit_callbacks.ModelSummary, callbacks.ModelSummary)
    assert our_lines == lit_lines
    assert len(our_lines) == (max_depth != 0)
    if max_depth:
        table = our_lines[0]
        assert "| eval  |" in table and "| [4, 8]   | [4, 32]" in table and "10.5 K    Total Flops" in table
        # the root's own parameter shows where the rows do not count every parameter once (the children)
        assert ("other params | n/a" in table) == (max_depth == 1)
        assert ("encoder.0" in table, "encoder.2.0" in table) == (max_depth != 1, max_depth == -1)


def test_rich_model_summary_prints_lightnings_rich_table(capsys):
    capsys.readouterr()
    summaries(2, lit_callbacks.RichModelSummary, callbacks.RichModelSummary)  # Lightning's first, then ours
    printed = capsys.readouterr().out
    theirs, mine = printed[: len(printed) // 2], printed[len(printed) // 2 :]
    assert mine == theirs
    assert (
        "┃ Name      ┃ Type" in mine
        and "│ 4 │ drop      │ Dropout    │" in mine
        and "Total FLOPs: 10.5 K" in mine
    )


def test_rich_model_summary_without_rich_is_a_one_line_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)
    with pytest.raises(
        ModuleNotFoundError, match="needs the `rich` package; install it: pip install -U rich"
    ):
        callbacks.RichModelSummary()


def test_model_summary_refuses_a_depth_below_minus_one():
    lit, _ = nets()
    lit_trainer, _ = trainers(Path("."), [lit_callbacks.ModelSummary(max_depth=-2)], [], max_steps=1)
    with pytest.raises(ValueError, match="max_depth"):
        lit_trainer.fit(lit, loader())
    with pytest.raises(ValueError, match="max_depth=-2 is invalid"):  # here at once, before any fit
        callbacks.ModelSummary(max_depth=-2)


# ---- TQDMProgressBar and RichProgressBar -----------------------------------------------------------------
class RecordedBar(our_progress.tqdm):
    """Our bar's tqdm, keeping its options, every position it moves to and the lines written above it."""

    made: list[dict] = []
    moves: list[int] = []
    lines: list[str] = []

    def __init__(self, *args, **kwargs):
        RecordedBar.made.append(kwargs)
        super().__init__(*args, **kwargs)

    def update(self, n=1):
        RecordedBar.moves.append(self.n + n)
        return super().update(n)

    @classmethod
    def write(cls, s, file=None, end="\n", nolock=False):
        cls.lines.append(s)


@pytest.fixture
def recorded_bar(monkeypatch):
    RecordedBar.made, RecordedBar.moves, RecordedBar.lines = [], [], []
    monkeypatch.setattr(our_progress, "tqdm", RecordedBar)
    return RecordedBar


def test_a_refresh_rate_moves_the_bar_where_lightnings_moves(monkeypatch, recorded_bar):
    """10 batches, refresh_rate=3: both bars show 3, 6, 9 and the last, 10 (ours with no minimum interval
    between redraws: Lightning's redraws at every move)."""

    class Eager(recorded_bar):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "mininterval": 0})

    monkeypatch.setattr(our_progress, "tqdm", Eager)
    lit_moves = []
    real_update = lit_tqdm_progress._update_n

    def update(bar, value):
        if "Epoch" in str(bar.desc):
            lit_moves.append(value)
        real_update(bar, value)

    monkeypatch.setattr(lit_tqdm_progress, "_update_n", update)
    lit, ours = nets()
    lit_trainer, our_trainer = trainers(
        Path("."), [lit_callbacks.TQDMProgressBar(refresh_rate=3)], [callbacks.TQDMProgressBar(refresh_rate=3)],
        max_epochs=1, enable_progress_bar=True,
    )  # fmt: skip
    lit_trainer.fit(lit, loader(n=80))
    our_trainer.fit(ours, loader(n=80))
    assert recorded_bar.moves == lit_moves == [3, 6, 9, 10]
    assert our_trainer.progress_bar_callback is our_trainer.callbacks[0]


def test_the_bar_moves_no_sooner_than_it_could_redraw(recorded_bar, tmp_path):
    """Off a terminal tqdm redraws at most every 10 s: the bar is moved at the first step, then not before
    that (a call into tqdm every step costs a small step ~1%), and at the last, which it shows."""
    _, ours = nets()
    Trainer(max_steps=10, logger=False, enable_checkpointing=False, default_root_dir=tmp_path).fit(
        ours, loader(n=80)
    )
    assert recorded_bar.moves == [1, 10]


def test_refresh_rate_zero_shows_no_bar_and_the_others_set_the_bars_options(recorded_bar, tmp_path):
    _, ours = nets()
    Trainer(callbacks=[callbacks.TQDMProgressBar(refresh_rate=0)], max_steps=2, logger=False,
            default_root_dir=tmp_path).fit(ours, loader())  # fmt: skip
    assert recorded_bar.made == []
    Trainer(callbacks=[callbacks.RichProgressBar(refresh_rate=20, leave=True)], max_epochs=2, logger=False,
            default_root_dir=tmp_path).fit(ours, loader(n=16))  # fmt: skip
    (options,) = recorded_bar.made
    assert options["mininterval"] == pytest.approx(0.05)
    assert len(recorded_bar.lines) == 2 and "4/4" in recorded_bar.lines[-1]  # a line kept per epoch


@pytest.mark.parametrize("bars", [["tqdm"], ["tqdm", "rich"]])
def test_progress_bar_callbacks_fail_where_lightnings_fail(bars):
    make = {"tqdm": "TQDMProgressBar", "rich": "RichProgressBar"}
    enabled = len(bars) > 1  # two bars fail even when the bar is on; one fails when it is off
    with pytest.raises(Exception, match="progress bar" if enabled else "enable_progress_bar=False"):
        pl.Trainer(callbacks=[getattr(lit_callbacks, make[b])() for b in bars], enable_progress_bar=enabled)
    with pytest.raises(
        ValueError, match="2 progress bars" if enabled else r"enable_progress_bar=False\) with"
    ):
        Trainer(callbacks=[getattr(callbacks, make[b])() for b in bars], enable_progress_bar=enabled)


# ---- DeviceStatsMonitor --------------------------------------------------------------------------------
class LitRows(pl.loggers.Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "rows"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, sorted(metrics)))


class OurRows(Logger):
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, sorted(metrics)))


def device_rows(rows: list) -> list[tuple[int, str, list[str]]]:
    """(step, hook, stats) of the DeviceStatsMonitor rows."""
    out = []
    for step, keys in rows:
        if keys and keys[0].startswith("DeviceStatsMonitor."):
            hooks = {k.split("/")[0] for k in keys}
            (hook,) = hooks
            out.append(
                (step, hook.removeprefix("DeviceStatsMonitor."), sorted(k.split("/")[1] for k in keys))
            )
    return out


@pytest.mark.parametrize("cpu_stats", [None, True, False])
def test_device_stats_are_logged_under_lightnings_keys_on_the_same_batches(cpu_stats):
    """8 steps, every 2nd logged, a validation of 2 batches (and the sanity check's 2) logging every 2nd: the
    same hooks and stats; the steps are the number of steps done (Lightning's one less after a step, README)."""
    lit_rows, our_rows = LitRows(), OurRows()
    lit, ours = nets()
    lit.validation_step = ours.validation_step = lambda batch, batch_idx: None
    flags = {"max_epochs": 1, "log_every_n_steps": 2}
    lit_trainer = pl.Trainer(callbacks=[lit_callbacks.DeviceStatsMonitor(cpu_stats)], logger=lit_rows,
                             default_root_dir="lightning", enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, accelerator="cpu", devices=1, **flags)  # fmt: skip
    our_trainer = Trainer(callbacks=[callbacks.DeviceStatsMonitor(cpu_stats)], logger=our_rows,
                          default_root_dir="ours", enable_progress_bar=False, enable_checkpointing=False, **flags)  # fmt: skip
    lit_trainer.fit(lit, loader(n=64), loader(n=16))
    our_trainer.fit(ours, loader(n=64), loader(n=16))
    theirs, mine = device_rows(lit_rows.rows), device_rows(our_rows.rows)
    assert [(hook, stats) for _, hook, stats in mine] == [(hook, stats) for _, hook, stats in theirs]
    if cpu_stats is False:
        assert mine == []
        return
    stats = ["cpu_percent", "cpu_swap_percent", "cpu_vm_percent"]
    hooks = ["on_validation_batch_start", "on_validation_batch_end"]  # the sanity check's, and the epoch's
    hooks += ["on_train_batch_start", "on_train_batch_end"] * 4 + hooks[:2]
    assert [(hook, s) for _, hook, s in mine] == [(hook, stats) for hook in hooks]
    assert [step for step, _, _ in theirs] == [0, 0, 1, 1, 3, 3, 5, 5, 7, 7, 7, 7]
    assert [step for step, _, _ in mine] == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8]
    assert not any(k.startswith("DeviceStatsMonitor") for k in our_trainer.callback_metrics)
