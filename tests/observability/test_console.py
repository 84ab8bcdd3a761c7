"""The console of a fit, as a terminal shows it: a line after each validation with what it logged, its
`prog_bar=True` values on the bar, and every log or `self.print` line above the bar, never drawn over it
(no fragment of the bar left in front of a line)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import logging, sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from trainer import Trainer, TrainModule
    from callbacks import Callback

    class LitModel(TrainModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 2:
                self.print("PRINTED from training_step")
            return nn.functional.mse_loss(self.layer(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))
            self.log("val_acc", 0.5, prog_bar=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Warns(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 1:  # the bar has just been drawn
                logging.getLogger("trainer").warning("a warning in the middle of the epoch")

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = Trainer(max_epochs=2, callbacks=[Warns()], enable_checkpointing=False,
                      default_root_dir=sys.argv[1], num_sanity_val_steps=0)
    trainer.fit(LitModel(), DataLoader(data, batch_size=16), DataLoader(data, batch_size=32))
    """
)


def screen(text: str) -> list[str]:
    """What a terminal shows of `text`: on each line, a carriage return goes back to its first column and
    what follows overwrites what was there (a shorter text leaves the rest standing)."""
    shown = []
    for raw in text.split("\n"):
        line = ""
        for part in raw.split("\r"):
            line = part + line[len(part) :]
        shown.append(line.rstrip())
    return shown


def test_screen_keeps_what_a_shorter_overwrite_leaves_standing():
    assert screen("train 1/8 loss=3.0\r[trainer] x\n") == ["[trainer] xoss=3.0", ""]
    assert screen("train 1/8\r         \r[trainer] x\n") == ["[trainer] x", ""]


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    """What a terminal shows of a short fit: stdout and stderr on one screen, unbuffered, so in the order
    a terminal gets them (one run for the tests below)."""
    root = tmp_path_factory.mktemp("console")
    script = root / "fit.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(root / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out.returncode == 0, out.stdout[-2000:]
    return screen(out.stdout)


def test_each_validation_prints_its_metrics_and_keeps_prog_bar_ones_on_the_bar(console):
    lines = console
    validations = [line for line in lines if line.startswith("validation at step")]
    assert [v.split(":")[0] for v in validations] == [
        "validation at step 4 (epoch 0)",
        "validation at step 8 (epoch 1)",
    ]
    assert all("val_loss=" in v and "val_acc=0.5" in v for v in validations)
    bar = [line for line in lines if "8/8" in line]
    assert bar and "val_acc=0.5" in bar[-1] and "val_loss" not in bar[-1]  # prog_bar ones only


def test_log_and_print_lines_go_above_the_bar_never_over_it(console):
    for marker in ("[trainer]", "PRINTED"):
        found = [line for line in console if marker in line]
        assert found, marker
        assert all(line.startswith(marker) for line in found), found  # nothing of the bar before it
    assert "[trainer] a warning in the middle of the epoch" in console
    assert "PRINTED from training_step" in console  # self.print (to stdout, as Lightning's)
