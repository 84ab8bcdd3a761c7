"""A second `fit` on the same Trainer after one that a callback stopped: Lightning clears `should_stop` as each
fit starts, so the next fit trains; it stopped at once here (the flag stayed set). The stop falls on the
epoch's last batch, where both count the epoch as done (inside an epoch the next fit here reads the epoch's
rest: README, "Coming from Lightning")."""

from __future__ import annotations

import pytorch_lightning as pl
from lightning_twins import assert_same_weights, loader, nets, trainers

from callbacks import Callback


def stop_at(base: type, step: int) -> object:
    """A callback (on `base`) that stops the fit after the optimizer step `step`."""

    class StopAt(base):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == step:
                trainer.should_stop = True

    return StopAt()


def test_a_fit_after_a_stopped_fit_trains_as_in_lightning(tmp_path):
    lit, ours = nets()
    lit_trainer, our_trainer = trainers(
        tmp_path, [stop_at(pl.Callback, 8)], [stop_at(Callback, 8)], max_epochs=2
    )
    for trainer, module in ((lit_trainer, lit), (our_trainer, ours)):
        trainer.fit(module, loader())
        assert (trainer.global_step, trainer.should_stop) == (8, True)
    lit_trainer.callbacks[:] = [c for c in lit_trainer.callbacks if not type(c).__name__ == "StopAt"]
    our_trainer.callbacks[:] = [c for c in our_trainer.callbacks if not type(c).__name__ == "StopAt"]
    for trainer, module in ((lit_trainer, lit), (our_trainer, ours)):
        trainer.fit(module, loader())
    assert our_trainer.global_step == lit_trainer.global_step == 16
    assert our_trainer.should_stop is lit_trainer.should_stop is False
    assert_same_weights(lit, ours)
