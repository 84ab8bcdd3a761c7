"""The logged gradient norm is the pre-clip global norm; after clipping the norm is at most the max, and
clipping at a threshold above the norm leaves the gradients as they are (FSDP and tp:
test_parallel3d_gradient_scale). The clipped gradients are read in on_before_zero_grad, after the optimizer
step: on_before_optimizer_step comes before clipping, as in Lightning."""

import pytest
import torch
from helpers import Regression, fit, quiet, read_metrics, regression_loader

from callbacks import Callback, NaNGuard
from trainer import Trainer


class RecordNorms(Callback):
    def __init__(self):
        self.reference, self.after = [], []

    def on_after_backward(self, trainer, module):
        copies = []
        for p in module.parameters():  # clip_grad_norm_ on copies, so the run's gradients stay untouched
            copies.append(torch.nn.Parameter(p.detach().clone()))
            copies[-1].grad = p.grad.detach().clone()
        self.reference.append(float(torch.nn.utils.clip_grad_norm_(copies, max_norm=float("inf"))))

    def on_before_zero_grad(self, trainer, module, optimizer):
        self.after.append(float(torch.nn.utils.get_total_norm([p.grad for p in module.parameters()])))


@pytest.mark.parametrize("precision", ["32", "16-mixed"])
def test_logged_norm_is_the_pre_clip_global_norm_and_clipping_bounds_it(tmp_path, precision):
    rec = RecordNorms()
    torch.manual_seed(0)
    Trainer(
        max_steps=8,
        gradient_clip_val=0.05,
        precision=precision,
        callbacks=[rec],
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        **quiet(),
    ).fit(Regression(lr=1e-3), regression_loader())
    logged = read_metrics(tmp_path, "train/grad_norm")
    # on_after_backward sees the true gradients: fp16's loss scale is already divided out
    assert [logged[s] for s in range(1, 9)] == pytest.approx(rec.reference, rel=1e-6)
    assert all(n > 0.05 for n in logged.values()), "the test needs norms above the clip value"
    assert all(n <= 0.05 * (1 + 1e-5) for n in rec.after)


class RecordGrads(Callback):
    """Each step's gradients as backward left them, and as the optimizer receives them (after clipping)."""

    def __init__(self):
        self.before, self.after = [], []

    def on_after_backward(self, trainer, module):
        self.before.append([p.grad.detach().clone() for p in module.parameters()])

    def on_before_zero_grad(self, trainer, module, optimizer):
        self.after.append([p.grad.detach().clone() for p in module.parameters()])


def test_clipping_at_a_threshold_above_the_norm_leaves_the_gradients_unchanged(tmp_path):
    rec = RecordGrads()
    fit(
        Regression(optimizer="sgd"), regression_loader(), tmp_path, 4, gradient_clip_val=10.0, callbacks=[rec]
    )
    norms = read_metrics(tmp_path, "train/grad_norm")
    assert len(rec.after) == 4 and max(norms.values()) < 5.0, f"the test needs norms below the clip: {norms}"
    for before, after in zip(rec.before, rec.after, strict=True):
        assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True)), "clipping changed them"


def test_clip_by_value_bounds_every_gradient_entry(tmp_path):
    seen = []

    class MaxAbs(Callback):
        def on_before_zero_grad(self, trainer, module, optimizer):
            seen.append(max(p.grad.abs().max().item() for p in module.parameters()))

    Trainer(
        max_steps=4,
        gradient_clip_val=1e-3,
        gradient_clip_algorithm="value",
        callbacks=[MaxAbs()],
        default_root_dir=tmp_path,
        **quiet(),
    ).fit(Regression(), regression_loader())
    assert seen and all(v <= torch.tensor(1e-3).item() for v in seen)  # 1e-3 in fp32
    assert max(read_metrics(tmp_path, "train/grad_norm").values()) > 1e-3


class NothingToLearn(Regression):
    """Every batch's loss is a constant that reaches no parameter (as a step over a batch with nothing
    to learn from may return): backward leaves every `.grad` None."""

    def training_step(self, batch, batch_idx):
        return torch.zeros((), requires_grad=True)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_a_step_without_gradients_logs_a_zero_norm_and_leaves_the_weights(tmp_path, clip):
    torch.manual_seed(0)
    module = NothingToLearn()
    before = [p.detach().clone() for p in module.parameters()]
    Trainer(
        max_steps=3,
        gradient_clip_val=clip,
        callbacks=[NaNGuard()],
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        **quiet(),
    ).fit(module, regression_loader())
    assert read_metrics(tmp_path, "train/grad_norm") == {1: 0.0, 2: 0.0, 3: 0.0}
    assert read_metrics(tmp_path, "nan_guard/skipped_steps") == {}  # a zero norm is a good step
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
