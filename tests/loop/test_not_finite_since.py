"""`Trainer.not_finite_since()` names the FIRST step whose model gave a non-finite loss, not the latest:
"the model is not finite since step N" must point where the trouble began, however long it went on."""

from __future__ import annotations

from helpers import ScriptedLoss, fit, regression_loader

from callbacks import Callback


class Since(Callback):
    """Records `trainer.not_finite_since()` after every step (every rank calls it, as it must)."""

    def __init__(self) -> None:
        self.seen: list[int | None] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append(trainer.not_finite_since())


def test_not_finite_since_keeps_the_first_non_finite_step(tmp_path):
    """The 3rd and 4th steps' losses are NaN and inf (the model after 2 and 3 updates gave them); the
    gradients stay zero, so the model stays finite and the later losses are finite again."""
    nan, inf = float("nan"), float("inf")
    since = Since()
    module = ScriptedLoss([1.0, 1.0, nan, inf, 1.0, 1.0])
    fit(module, regression_loader(), tmp_path, 6, callbacks=[since], enable_checkpointing=False)
    assert since.seen == [None, None, 2, 2, 2, 2]
