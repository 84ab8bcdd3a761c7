"""fp16 ("16-mixed") with a step whose update is skipped, by NaNGuard or by a callback: the loss scaler
unscaled that step's gradients, so the skip must still close the scaler's step, or the next step's
unscale fails ("unscale_() has already been called on this optimizer since the last update()")."""

from __future__ import annotations

from helpers import Regression, fit, regression_loader

from callbacks import Callback, NaNGuard


class NaNAt(Regression):
    """SGD, and the loss of optimizer step `step` (1-based) is NaN."""

    def __init__(self, step: int) -> None:
        super().__init__(optimizer="sgd")
        self.step, self.calls = step, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.calls == self.step else loss


class SkipsStep(Callback):
    """Skips the update of optimizer step `step` (1-based), as any callback may."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step + 1 == self.step:
            trainer.skip_optimizer_step("test: skipped by a callback")


def test_fp16_nan_guard_skip_then_training_goes_on(tmp_path):
    guard = NaNGuard(rollback_after=None)
    trainer = fit(
        NaNAt(2),
        regression_loader(),
        tmp_path,
        4,
        precision="16-mixed",
        callbacks=[guard],
        enable_checkpointing=False,
    )
    assert trainer.global_step == 4
    assert guard.skipped == 1 and trainer.state.skipped_steps == 1
    assert trainer.strategy.precision.scaler.get_scale() == 2.0**15  # the NaN step halved the initial 2**16


def test_fp16_callback_skip_then_training_goes_on(tmp_path):
    module = Regression(optimizer="sgd")
    trainer = fit(
        module, regression_loader(), tmp_path, 4, precision="16-mixed", callbacks=[SkipsStep(2)],
        enable_checkpointing=False,
    )  # fmt: skip
    assert trainer.global_step == 4 and trainer.state.skipped_steps == 1
