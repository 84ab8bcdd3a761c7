"""DPSGDStrategy as a user runs it: a plain classifier whose `training_step` calls `self(x)` and logs.
Noise-free DP-SGD is plain SGD; the noise has the calibrated std; 2 processes train like 1; the budget
stops the run with a checkpoint and survives a resume; bad input is named."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from dp_sgd_script import Classifier, Grads, Silent, data, fit, runs, weights
from helpers import REPO, SCRIPTS, failure, quiet, read_metrics, run_cli, run_ranks
from torch import nn
from torch.utils.data import DataLoader

from strategies.dp_sgd import DPSGDStrategy, compute_epsilon
from strategies.privacy.accounting import PrivacyAccountant
from trainer import Trainer


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A one-process DPSGDStrategy run joins a world of one; later tests must start outside any world."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_without_noise_and_with_a_huge_clip_norm_the_update_is_plain_sgds(tmp_path):
    private = seeded_classifier()
    fit(tmp_path / "dp", 1, private, noise_multiplier=0.0, max_grad_norm=1e6, poisson_sampling=False)
    reference = seeded_classifier()
    Trainer(max_steps=6, default_root_dir=tmp_path / "plain", enable_checkpointing=False, **quiet()).fit(
        reference, DataLoader(data(), batch_size=8)
    )
    assert weights(private) == pytest.approx(weights(reference), abs=1e-6)


def test_clipping_bounds_each_samples_contribution(tmp_path):
    grads = Grads()
    fit(tmp_path, 1, Classifier(), [grads], noise_multiplier=0.0, max_grad_norm=0.01, max_steps=4)
    # every sample is clipped to norm 0.01, so the mean over a batch is at most 0.01 x batch / expected
    metrics = read_metrics(tmp_path, "privacy/batch_size")
    for step, g in enumerate(grads.grads, start=1):
        assert float(g.norm()) <= 0.01 * metrics[step] / 8 + 1e-7
        assert float(g.norm()) > 0.0
    assert set(read_metrics(tmp_path, "privacy/clipped_fraction").values()) == {1.0}


def test_noise_std_is_noise_multiplier_times_clip_norm_over_the_expected_batch(tmp_path):
    grads = Grads()
    fit(tmp_path, 1, Silent(), [grads], max_steps=3, batch_size=16, noise_multiplier=1.3, max_grad_norm=0.5)
    expected = 1.3 * 0.5 / 16
    for g in grads.grads:  # 10100 coordinates a step: the std is known to about 1.4% (2 sigma)
        assert float(g.std()) == pytest.approx(expected, rel=0.03)
        assert abs(float(g.mean())) < 4 * expected / g.numel() ** 0.5
    assert not torch.equal(grads.grads[0], grads.grads[1])  # a fresh draw each step


@pytest.mark.slow
def test_two_processes_train_as_one_and_carry_the_same_noise(tmp_path):
    run_ranks(2, SCRIPTS / "dp_sgd_script.py", str(tmp_path / "two"), timeout=300)
    two = json.loads((tmp_path / "two" / "result.json").read_text())
    one = runs(tmp_path / "one", 1)
    assert two["train"]["weights"] == pytest.approx(one["train"]["weights"], abs=1e-5)
    assert two["train"]["epsilon"] == pytest.approx(one["train"]["epsilon"], rel=1e-9)
    expected = 1.0 * 1.0 / 16
    for run in (one, two):
        assert run["noise"]["std"] == pytest.approx([expected] * 3, rel=0.03)

    # the 2-process run's 4 steps (q = 4 x 2 / 96) resumed on 1 process (q = 4 / 96) keep counting
    resumed = fit(tmp_path / "two" / "resume", 1, Classifier(), max_steps=7, batch_size=4, ckpt_path="last")
    assert resumed.global_step == 7
    assert resumed.strategy.accountant.history == [(1.0, 8 / 96, 4), (1.0, 4 / 96, 3)]
    both = PrivacyAccountant()
    both.step(1.0, 8 / 96, 4)
    both.step(1.0, 4 / 96, 3)
    spent = read_metrics(tmp_path / "two" / "resume", "privacy/epsilon")[7]
    assert spent == pytest.approx(both.epsilon(1e-5), rel=1e-9)
    assert spent > PrivacyAccountant().epsilon_after(7, 1.0, 4 / 96, 1e-5)  # the first 4 steps cost more


def seeded_classifier():
    torch.manual_seed(1)
    return Classifier()


def test_physical_chunks_and_ghost_clipping_give_the_same_update(tmp_path):
    reference = seeded_classifier()
    fit(tmp_path / "a", 1, reference, max_steps=3)
    chunked = seeded_classifier()
    fit(tmp_path / "b", 1, chunked, max_steps=3, max_physical_batch_size=3)
    ghost = seeded_classifier()
    fit(tmp_path / "c", 1, ghost, max_steps=3, grad_sample_mode="ghost")
    untrained = seeded_classifier()
    assert weights(reference) != pytest.approx(weights(untrained), abs=1e-3)
    assert weights(chunked) == pytest.approx(weights(reference), abs=1e-6)
    assert weights(ghost) == pytest.approx(weights(reference), abs=1e-6)


def test_poisson_batches_vary_in_size_and_an_empty_one_is_only_noise(tmp_path):
    fit(tmp_path, 1, Classifier(), max_steps=40, batch_size=1)  # q = 1/96: most batches are empty
    sizes = list(read_metrics(tmp_path, "privacy/batch_size").values())
    assert len(sizes) == 40 and 0.0 in sizes and max(sizes) >= 1.0
    eps = list(read_metrics(tmp_path, "privacy/epsilon").values())
    assert eps == sorted(eps) and eps[0] < eps[-1]  # every step is counted, empty or not


def budget_run(root, max_steps=50, ckpt_path=None):
    torch.manual_seed(0)
    strategy = DPSGDStrategy(noise_multiplier=1.0, target_epsilon=3.0, noise_seed=5)
    trainer = Trainer(strategy=strategy, max_steps=max_steps, default_root_dir=root, **quiet())
    trainer.fit(Classifier(), DataLoader(data(), batch_size=8), ckpt_path=ckpt_path)
    return trainer


def test_the_budget_stops_the_run_before_it_is_exceeded_and_a_resume_keeps_it_spent(tmp_path, caplog):
    accountant, allowed = PrivacyAccountant(), 0
    while accountant.epsilon_after(1, 1.0, 8 / 96, 1e-5) <= 3.0:
        accountant.step(1.0, 8 / 96)
        allowed += 1
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer = budget_run(tmp_path)
    assert 0 < allowed < 50 and trainer.global_step == allowed
    assert (tmp_path / "checkpoints" / f"step-{allowed:08d}").is_dir()
    assert any("privacy budget" in r.message and "target_epsilon 3.0" in r.message for r in caplog.records)
    spent = read_metrics(tmp_path, "privacy/epsilon")[allowed]
    assert spent <= 3.0

    again = budget_run(tmp_path, ckpt_path="last")
    assert again.global_step == allowed  # nothing left to spend
    assert again.strategy.accountant.steps == allowed


def test_a_resumed_run_counts_on_from_the_checkpoints_history(tmp_path):
    first = budget_run(tmp_path, max_steps=5)
    assert first.strategy.accountant.steps == 5
    resumed = budget_run(tmp_path, max_steps=8, ckpt_path="last")
    assert resumed.global_step == 8 and resumed.strategy.accountant.steps == 8
    eps = read_metrics(tmp_path, "privacy/epsilon")
    assert eps[8] == pytest.approx(PrivacyAccountant().epsilon_after(8, 1.0, 8 / 96, 1e-5), rel=1e-9)


class WithBatchNorm(Classifier):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))


@pytest.mark.parametrize(
    "strategy, trainer_kwargs, module, match",
    [
        ({"noise_multiplier": 1.0}, {}, WithBatchNorm, "BatchNorm"),
        ({}, {}, Classifier, "noise_multiplier or target_epsilon"),
        ({"target_epsilon": 2.0}, {}, Classifier, "exactly one of epochs=, steps="),
        ({"noise_multiplier": 1.0, "delta": 2.0}, {}, Classifier, "delta=2.0"),
        ({"noise_multiplier": 1.0, "clipping": "layer"}, {}, Classifier, "clipping"),
        ({"noise_multiplier": 1.0}, {"precision": "16-mixed"}, Classifier, "16-mixed"),
        ({"noise_multiplier": 1.0}, {"gradient_clip_val": 1.0}, Classifier, "gradient_clip_val"),
        ({"noise_multiplier": 1.0}, {"accumulate_grad_batches": 2}, Classifier, "max_physical_batch_size"),
    ],
)
def test_bad_input_is_named(tmp_path, strategy, trainer_kwargs, module, match):
    with pytest.raises(ValueError, match=match):
        trainer = Trainer(
            strategy=DPSGDStrategy(**strategy), default_root_dir=tmp_path, max_steps=2, **trainer_kwargs
        )
        trainer.fit(module(), DataLoader(data(), batch_size=8))


def test_target_epsilon_alone_calibrates_the_noise_to_spend_it_over_the_run(tmp_path):
    strategy = DPSGDStrategy(target_epsilon=2.0, epochs=1, noise_seed=1)
    trainer = Trainer(strategy=strategy, max_epochs=1, default_root_dir=tmp_path, **quiet())
    trainer.fit(Classifier(), DataLoader(data(), batch_size=8))
    assert trainer.global_step == 12  # 1 / q steps in an epoch
    spent = read_metrics(tmp_path, "privacy/epsilon")[12]
    assert spent == pytest.approx(2.0, rel=0.01) and spent <= 2.0


@pytest.mark.slow
def test_the_dpsgd_recipe_trains_and_stops_at_its_budget(tmp_path):
    root = tmp_path / "run"
    done = run_cli(
        "fit", str(REPO / "recipes" / "dpsgd_tiny.yaml"),
        "trainer.max_steps=60", "trainer.val_check_interval=30", "trainer.limit_val_batches=2",
        "data.batch_size=16", "strategy.target_epsilon=1.245", "strategy.noise_seed=0", "trainer.log_every_n_steps=1",
        f"trainer.default_root_dir={root}", cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, failure(done.stderr)
    rows = [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]
    q = next(r["privacy/sample_rate"] for r in rows if "privacy/sample_rate" in r)
    accountant, allowed = PrivacyAccountant(), 0
    while accountant.epsilon_after(1, 0.8, q, 1e-5) <= 1.245:
        accountant.step(0.8, q)
        allowed += 1
    assert 0 < allowed < 60
    assert f"stopping at step {allowed} (privacy budget" in done.stderr + done.stdout
    assert (root / "checkpoints" / f"step-{allowed:08d}").is_dir()
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < losses[0] - 0.7, losses  # it learns under the noise


def test_per_layer_clipping_and_the_prv_accountant_run_as_configured(tmp_path):
    grads = Grads()
    trainer = fit(tmp_path / "a", 1, Classifier(), [grads], noise_multiplier=0.0, max_grad_norm=0.01,
                  clipping="per_layer", max_steps=3)  # fmt: skip
    sizes = read_metrics(tmp_path / "a", "privacy/batch_size")
    for step, g in enumerate(grads.grads, start=1):  # each layer within C/sqrt(layers): the whole within C
        assert 0.0 < float(g.norm()) <= 0.01 * sizes[step] / 8 + 1e-7
    assert trainer.strategy.clipping == "per_layer"

    rdp = fit(tmp_path / "rdp", 1, Classifier(), max_steps=5)
    prv = fit(tmp_path / "prv", 1, Classifier(), max_steps=5, accountant="prv")
    eps_rdp, eps_prv = rdp.callback_metrics["privacy/epsilon"], prv.callback_metrics["privacy/epsilon"]
    assert eps_prv == pytest.approx(compute_epsilon(1.0, 8 / 96, 5, 1e-5, accountant="prv"), rel=1e-9)
    assert eps_prv < eps_rdp
