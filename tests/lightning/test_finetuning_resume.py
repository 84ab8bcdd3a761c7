"""BackboneFinetuning resumed from a checkpoint written after its unfreeze epoch, under PyTorch Lightning and here:
the resumed fit re-adds the param groups the callback recorded before the optimizer's state loads (Lightning's
`on_fit_start`, before its `restore_training_state`), then goes on as Lightning's does: the same groups, LRs
per step and weights."""

from __future__ import annotations

import pytest
from test_callbacks_ported_2 import CALLBACKS, assert_same_lrs, assert_same_state, module, state, trainer


@pytest.mark.parametrize("train_bn", [True, False])
def test_backbone_finetuning_resumed_after_the_unfreeze_goes_on_as_lightnings(tmp_path, train_bn):
    """3 epochs (the backbone unfrozen at epoch 1, its group's LR doubled at 2), a checkpoint, then a new
    Trainer resumes from it for 2 more epochs."""
    resumed = {}
    for framework in ("lightning", "ours"):
        root = tmp_path / framework

        def finetuning(framework=framework):
            return [CALLBACKS[framework].BackboneFinetuning(unfreeze_backbone_at_epoch=1, train_bn=train_bn)]

        first = trainer(framework, root / "first", finetuning(), max_epochs=3)
        first.fit(module(framework, batch_norm=True, momentum=0.9))
        path = root / "after_unfreeze.ckpt"
        first.save_checkpoint(path)
        callbacks = finetuning()
        model = module(framework, batch_norm=True, momentum=0.9)
        trainer(framework, root / "second", callbacks, max_epochs=5).fit(model, ckpt_path=path)
        resumed[framework] = (model, callbacks[0])
    (theirs, lit_cb), (ours, our_cb) = resumed["lightning"], resumed["ours"]
    assert [len(groups) for groups, _, _ in ours.epochs] == [2, 2]
    assert ours.epochs == theirs.epochs  # groups, their LRs and what requires grad, per resumed epoch
    assert_same_lrs(ours.lrs, theirs.lrs)
    assert ours.seen == theirs.seen
    assert_same_state(state(ours), state(theirs))
    assert our_cb.previous_backbone_lr == lit_cb.previous_backbone_lr
