import math

import pytest
import torch

from trainer.core.schedules import LRSchedule, build_scheduler


def lrs(schedule: LRSchedule, steps: int, peak: float = 1.0) -> list[float]:
    """The lr used by each optimizer step, through a real optimizer + LambdaLR."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = build_scheduler(opt, schedule)
    used = []
    for _ in range(steps):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return used


def test_warmup_is_linear_from_zero_and_reaches_peak_at_its_last_step():
    used = lrs(LRSchedule("cosine", warmup_steps=10, total_steps=100), 12, peak=2.0)
    assert used[0] == pytest.approx(2.0 * 1 / 10)
    assert used[4] == pytest.approx(2.0 * 5 / 10)
    assert used[9] == pytest.approx(2.0)


def test_cosine_matches_closed_form_in_the_middle_and_ends_at_min_ratio():
    w, t, r = 10, 110, 0.1
    used = lrs(LRSchedule("cosine", w, t, min_lr_ratio=r), t + 5)
    mid = w + (t - w) // 2
    assert used[mid] == pytest.approx(r + (1 - r) * 0.5 * (1 + math.cos(math.pi * 0.5)))
    quarter = w + (t - w) // 4
    assert used[quarter] == pytest.approx(r + (1 - r) * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert used[t] == pytest.approx(r)
    assert used[t + 4] == pytest.approx(r)  # stays at the floor past the end


def test_linear_matches_closed_form():
    used = lrs(LRSchedule("linear", 0, 100, min_lr_ratio=0.2), 101)
    assert used[0] == pytest.approx(1.0)
    assert used[50] == pytest.approx(1 - 0.8 * 0.5)
    assert used[100] == pytest.approx(0.2)


def test_wsd_is_stable_then_decays_over_the_last_fraction():
    used = lrs(LRSchedule("wsd", 5, 100, min_lr_ratio=0.0, decay_fraction=0.2), 101)
    assert used[4] == pytest.approx(1.0)
    assert used[79] == pytest.approx(1.0)
    assert used[80] == pytest.approx(1.0)  # decay starts at step 80
    assert used[90] == pytest.approx(0.5)
    assert used[100] == pytest.approx(0.0)


def test_constant_after_warmup():
    used = lrs(LRSchedule("constant", 4, 10), 10)
    assert used[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert used[4:] == pytest.approx([1.0] * 6)


def test_a_one_step_decay_window_reaches_the_floor_when_it_ends():
    # wsd: the last round(0.2 * 5) = 1 step decays; linear/cosine: warmup leaves a single decay step
    for schedule in (
        LRSchedule("wsd", 0, 5, min_lr_ratio=0.3),
        LRSchedule("linear", 4, 5, min_lr_ratio=0.3),
        LRSchedule("cosine", 4, 5, min_lr_ratio=0.3),
    ):
        used = lrs(schedule, 7)
        assert used[4] == pytest.approx(1.0), schedule.name  # the decay's first step is at the peak
        assert used[5:] == pytest.approx([0.3, 0.3]), schedule.name  # done: the floor, and it stays


def test_a_constant_schedule_may_warm_up_for_longer_than_the_run():
    used = lrs(LRSchedule("constant", warmup_steps=8, total_steps=4), 4)
    assert used == pytest.approx([1 / 8, 2 / 8, 3 / 8, 4 / 8])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"name": "exp", "warmup_steps": 0, "total_steps": 10},
            "lr_schedule='exp' is unknown; allowed: constant, linear, cosine, wsd",
        ),
        ({"name": "cosine", "warmup_steps": -1, "total_steps": 10}, "warmup_steps=-1"),
        (
            {"name": "cosine", "warmup_steps": 10, "total_steps": 10},
            "warmup_steps=10 leaves no room to decay in 10 total steps; allowed: warmup_steps < max_steps",
        ),
        ({"name": "cosine", "warmup_steps": 0, "total_steps": 10, "min_lr_ratio": 2.0}, "min_lr_ratio=2.0"),
        (
            {"name": "wsd", "warmup_steps": 0, "total_steps": 10, "decay_fraction": 0.0},
            r"decay_fraction=0.0 is invalid; allowed: a float in \(0, 1\]",
        ),
        (
            {"name": "wsd", "warmup_steps": 0, "total_steps": 10, "decay_fraction": 1.5},
            r"decay_fraction=1.5 is invalid; allowed: a float in \(0, 1\]",
        ),
    ],
)
def test_bad_schedule_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LRSchedule(**kwargs)


def test_a_step_interval_scheduler_from_configure_optimizers_steps_once_per_optimizer_step(tmp_path):
    from helpers import Regression, quiet, read_metrics, regression_loader

    from trainer import Trainer

    class OwnSchedule(Regression):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    Trainer(max_steps=6, accumulate_grad_batches=3, default_root_dir=tmp_path, **quiet()).fit(
        OwnSchedule(), regression_loader()
    )
    assert list(read_metrics(tmp_path, "train/lr").values()) == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]


def test_own_scheduler_and_trainer_schedule_together_is_an_error(tmp_path):
    from helpers import Regression, quiet, regression_loader

    from trainer import Trainer

    class OwnSchedule(Regression):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2)}

    with pytest.raises(
        ValueError, match="returned its own lr_scheduler and the Trainer has lr_schedule='cosine'"
    ):
        Trainer(max_steps=6, lr_schedule="cosine", default_root_dir=tmp_path, **quiet()).fit(
            OwnSchedule(), regression_loader()
        )
