"""Lightning's manual optimization (`automatic_optimization = False`). Its documented GAN and gradient
accumulation (tests/scripts/manual_parity.py) run on PyTorch Lightning and here with only the import changed:
the same hooks in the same order, each optimizer step's loss, learning rate and `global_step`, what
on_train_batch_end received, the logged metrics and the final weights; a resumed GAN continues bit-exact. In
this process: two optimizers stepped by hand against plain PyTorch and torch's AMP recipe, `toggle_optimizer`,
and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, quiet, read_metrics, regression_loader, run_ranks
from torch import nn

from callbacks import Callback, LearningRateMonitor
from strategies import DPSGDStrategy, FSDPStrategy, Parallel3DStrategy
from trainer import Trainer, TrainModule
from trainer.checkpoint import CheckpointError

SCRIPT = SCRIPTS / "manual_parity.py"
FORMS = ["gan", "gan_dicts", "gan_tuple", "closure"]


def run(out: Path, framework: str, forms: list[str], *args: str) -> dict[str, dict]:
    """{form: its record} of one process of manual_parity.py under `framework`."""
    run_ranks(1, SCRIPT, framework, str(out), ",".join(forms), *args, timeout=240)
    return {form: json.loads((out / form / "rank0.json").read_text()) for form in forms}


def assert_same_run(lightning: dict, here: dict, unlike: tuple[str, ...] = ()) -> None:
    assert here["calls"] == lightning["calls"]
    assert [(s["opt"], s["step"], s["lr"]) for s in here["steps"]] == [
        (s["opt"], s["step"], s["lr"]) for s in lightning["steps"]
    ]
    assert [s["loss"] for s in here["steps"]] == pytest.approx(
        [s["loss"] for s in lightning["steps"]], abs=1e-6
    )
    assert len(here["batch_outputs"]) == len(lightning["batch_outputs"])
    for ours, theirs in zip(here["batch_outputs"], lightning["batch_outputs"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-6)
    assert {k: v for k, v in here["attrs"].items() if k not in unlike} == {
        k: v for k, v in lightning["attrs"].items() if k not in unlike
    }
    for kind in ("logged_metrics", "callback_metrics"):
        assert here[kind] == pytest.approx(lightning[kind], abs=1e-6), kind
    for name, value in lightning["weights"].items():
        assert here["weights"][name] == pytest.approx(value, abs=1e-6), name


@pytest.mark.slow
def test_every_form_runs_as_under_lightning(tmp_path):
    every = ("--val-every", "3")  # val_check_interval=3: after every third batch
    lightning, here = (
        run(tmp_path / "pl", "lightning", FORMS, *every),
        run(tmp_path / "here", "trainer", FORMS, *every),
    )
    for form in FORMS:
        assert_same_run(lightning[form], here[form])
    gan = here["gan"]
    # two optimizer steps per batch, 6 batches an epoch, 2 epochs: each step is a global step
    assert [s["step"] for s in gan["steps"]] == list(range(1, 25)) and gan["attrs"]["global_step"] == 24
    assert len({s["lr"] for s in gan["steps"]}) > 4  # both schedulers, stepped by hand, moved the rates
    assert gan["attrs"]["optimizers"] == gan["attrs"]["schedulers"] == 2
    assert gan["attrs"]["validated_at"] == [6, 12, 18, 24]  # intervals count batches, as Lightning's
    assert gan["calls"][:7] == [
        "cb.on_train_batch_start", "on_train_batch_start", "on_before_backward", "cb.on_after_backward",
        "on_after_backward", "cb.on_before_optimizer_step", "on_before_optimizer_step",
    ]  # fmt: skip
    assert "on_before_zero_grad" not in gan["calls"]  # zero_grad is the module's own call
    closure = here[
        "closure"
    ]  # a step every other batch, from a closure; the optimizer unwrapped from its list
    assert (
        closure["attrs"]["global_step"] == 6 and [s["lr"] for s in closure["steps"]] == [0.1] * 3 + [0.05] * 3
    )


@pytest.mark.slow
def test_max_steps_counts_the_steps_of_every_optimizer_as_lightning_does(tmp_path):
    lightning = run(tmp_path / "pl", "lightning", ["gan"], "--max-steps", "7")["gan"]
    here = run(tmp_path / "here", "trainer", ["gan"], "--max-steps", "7")["gan"]
    # a batch's two steps take global_step from 6 to 8: the fit stops after it, at 8. Lightning's
    # current_epoch then reads 1, here 0: as under automatic optimization (an epoch stopped by max_steps)
    assert_same_run(lightning, here, unlike=("epoch",))
    assert here["attrs"]["global_step"] == 8 and len(here["batch_outputs"]) == 4


@pytest.mark.slow
def test_a_resumed_gan_continues_bit_exact(tmp_path):
    full = run(tmp_path / "full", "trainer", ["gan"])["gan"]
    # three batches of the first epoch, saved; then the rest from there in a new process
    part = run(tmp_path / "part", "trainer", ["gan"], "--max-steps", "6", "--save")["gan"]
    saved = tmp_path / "part" / "gan" / "saved"
    resumed = run(tmp_path / "resumed", "trainer", ["gan"], "--ckpt-path", str(saved))["gan"]
    assert part["steps"] + resumed["steps"] == full["steps"]
    assert resumed["weights"] == full["weights"]  # both optimizers' momentum and both schedulers restored
    assert resumed["callback_metrics"] == full["callback_metrics"]
    assert resumed["attrs"] == full["attrs"]


class TwoHeads(TrainModule):
    """Two optimizers stepped by hand in each batch, the second's gradients clipped: what `plain_run` does."""

    def __init__(self, clip: float | None = 0.05):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 1), nn.Linear(8, 1)
        self.clip, self.seen_requires_grad = clip, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        with self.toggled_optimizer(opt_a):
            self.seen_requires_grad.append([p.requires_grad for p in self.parameters()])
            loss_a = nn.functional.mse_loss(self.a(x) + self.b(x), y)
            opt_a.zero_grad()
            self.manual_backward(loss_a)
            opt_a.step()
        loss_b = nn.functional.mse_loss(self.b(x) * 2.0, y)
        opt_b.zero_grad()
        self.manual_backward(loss_b)
        self.clip_gradients(opt_b, gradient_clip_val=self.clip)
        opt_b.step()
        return loss_b

    def configure_optimizers(self):
        return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.2)]


def plain_run(batches: int) -> list[torch.Tensor]:
    """TwoHeads' steps written in plain PyTorch."""
    module = TwoHeads()
    opt_a = torch.optim.SGD(module.a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(module.b.parameters(), lr=0.2)
    for x, y in list(regression_loader())[:batches]:
        opt_a.zero_grad()
        (module.a(x) + module.b(x).detach()).sub(y).pow(2).mean().backward()
        opt_a.step()
        opt_b.zero_grad()
        nn.functional.mse_loss(module.b(x) * 2.0, y).backward()
        torch.nn.utils.clip_grad_norm_(module.b.parameters(), 0.05)
        opt_b.step()
    return [p.detach() for p in module.parameters()]


def test_two_optimizers_stepped_by_hand_match_plain_pytorch_and_count_global_steps(tmp_path):
    module = TwoHeads()
    trainer = Trainer(max_steps=5, default_root_dir=tmp_path, **quiet())
    trainer.fit(module, regression_loader())
    assert trainer.global_step == 6  # each batch's two steps count: 5 is passed in the third batch
    assert len(trainer.optimizers) == 2 and trainer.optimizer is trainer.optimizers[0]
    for got, expected in zip(module.parameters(), plain_run(3), strict=True):
        torch.testing.assert_close(got.detach(), expected, rtol=0, atol=1e-7)
    # inside the toggle only opt_a's parameters (a's) required gradients; after it, all again
    assert module.seen_requires_grad == [[True, True, False, False]] * 3
    assert all(p.requires_grad for p in module.parameters())


def test_under_fp16_each_optimizer_steps_as_torchs_amp_recipe(tmp_path):
    """The loss scaled in `manual_backward`; gradients unscaled once per step, before `clip_gradients` reads
    them; the scaler steps and updates per optimizer step (as Lightning's does), skipping overflows."""
    module = TwoHeads()
    Trainer(max_steps=6, precision="16-mixed", accelerator="cpu", default_root_dir=tmp_path, **quiet()).fit(
        module, regression_loader()
    )
    plain = TwoHeads()
    opt_a = torch.optim.SGD(plain.a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(plain.b.parameters(), lr=0.2)
    scaler = torch.amp.GradScaler("cpu")
    for x, y in list(regression_loader())[:3]:
        with torch.autocast("cpu", dtype=torch.float16):
            loss_a = nn.functional.mse_loss(plain.a(x) + plain.b(x).detach(), y)
        opt_a.zero_grad()
        scaler.scale(loss_a).backward()
        scaler.step(opt_a)
        scaler.update()
        with torch.autocast("cpu", dtype=torch.float16):
            loss_b = nn.functional.mse_loss(plain.b(x) * 2.0, y)
        opt_b.zero_grad()
        scaler.scale(loss_b).backward()
        scaler.unscale_(opt_b)
        torch.nn.utils.clip_grad_norm_(plain.b.parameters(), 0.05)
        scaler.step(opt_b)
        scaler.update()
    for got, expected in zip(module.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=0, atol=0)


def test_untoggling_restores_what_was_frozen_before(tmp_path):
    module = TwoHeads()
    module.b.bias.requires_grad_(False)  # frozen by the user: stays frozen, as in Lightning
    trainer = Trainer(max_steps=2, default_root_dir=tmp_path, **quiet())
    trainer.fit(module, regression_loader())
    assert [p.requires_grad for p in module.parameters()] == [True, True, True, False]


def test_a_checkpoint_of_two_optimizers_refuses_a_module_with_one(tmp_path):
    trainer = Trainer(max_steps=2, default_root_dir=tmp_path, **quiet())
    trainer.fit(TwoHeads(), regression_loader())
    saved = trainer.save_checkpoint(tmp_path / "two")

    class OneHead(TwoHeads):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(
        CheckpointError, match=r"holds the state of 2 optimizer\(s\), configure_optimizers returned 1"
    ):
        Trainer(max_steps=4, default_root_dir=tmp_path / "one", **quiet()).fit(
            OneHead(), regression_loader(), ckpt_path=saved
        )


@pytest.mark.parametrize(
    "flags, match",
    [
        ({"gradient_clip_val": 0.5}, r"gradient_clip_val=0.5 with TwoHeads's manual optimization: .*clip_gradients"),
        ({"accumulate_grad_batches": 2}, r"accumulate_grad_batches=2 with TwoHeads's manual optimization"),
        ({"lr_schedule": "cosine"}, r"lr_schedule='cosine', warmup_steps=0 with TwoHeads's manual optimization"),
    ],
)  # fmt: skip
def test_trainer_flags_that_do_the_modules_work_are_refused_before_training(tmp_path, flags, match):
    module = TwoHeads()
    with pytest.raises(ValueError, match=match):
        Trainer(max_steps=2, default_root_dir=tmp_path, **quiet(**flags)).fit(module, regression_loader())
    assert module.seen_requires_grad == []


@pytest.mark.parametrize(
    "strategy, devices, match",
    [
        (lambda: Parallel3DStrategy(pp=2), 2, r"TwoHeads optimizes manually, but pp=2 runs each step's forward and backward"),
        (lambda: Parallel3DStrategy(tp=2), 2, r"TwoHeads optimizes manually, with tp=2: .*allowed with manual optimization: tp=cp=ep=1"),
        (lambda: FSDPStrategy(zero_stage=1), 2, r"TwoHeads optimizes manually, but zero_stage=1 slices"),
        (lambda: DPSGDStrategy(noise_multiplier=1.0), 1, r"TwoHeads optimizes manually, but DPSGDStrategy computes"),
    ],
    ids=["pipeline", "tensor-parallel", "zero1", "dp-sgd"],
)  # fmt: skip
def test_layouts_that_own_part_of_the_step_are_refused_before_any_process_starts(
    tmp_path, strategy, devices, match
):
    trainer = Trainer(
        strategy=strategy(), accelerator="cpu", devices=devices, default_root_dir=tmp_path, **quiet()
    )
    with pytest.raises(ValueError, match=match):
        trainer.fit(TwoHeads(), regression_loader())


class Automatic(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.manual_backward(loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_backward_under_automatic_optimization_says_how_to_switch(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"manual_backward is for manual optimization: set `self.automatic"
    ):
        Trainer(max_steps=1, default_root_dir=tmp_path, **quiet()).fit(Automatic(), regression_loader())


class Misconfigured(TwoHeads):
    def __init__(self, mistake: str):
        super().__init__()
        self.mistake = mistake

    def training_step(self, batch, batch_idx):
        if self.mistake == "clip":
            self.clip_gradients(self.optimizers()[0], gradient_clip_val=1.0, gradient_clip_algorithm="max")
        return "a string" if self.mistake == "output" else None

    def configure_optimizers(self):
        if self.mistake == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        return super().configure_optimizers()


@pytest.mark.parametrize(
    "mistake, error, match",
    [
        ("clip", ValueError, r"gradient_clip_algorithm='max' is invalid; allowed: 'norm', 'value'"),
        ("output", TypeError, r"training_step returned str under manual optimization; allowed: a tensor, a dict or None"),
        ("lbfgs", TypeError, r"LBFGS re-evaluates its closure inside step\(\)"),
    ],
)  # fmt: skip
def test_a_manual_step_misused_fails_in_one_line(tmp_path, mistake, error, match):
    with pytest.raises(error, match=match):
        Trainer(max_steps=1, default_root_dir=tmp_path, **quiet()).fit(
            Misconfigured(mistake), regression_loader()
        )


def test_what_a_batch_logs_is_in_callback_metrics_at_its_on_train_batch_end(tmp_path):
    """As in Lightning (and the automatic step): an on_train_batch_end callback reads what that batch's
    training_step logged, on batches that write a row (every 2nd here) and on the others; the rows hold it."""

    class LogsBatch(TwoHeads):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("batch", float(batch_idx))
            return loss

    seen = []

    class Reads(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(
                [batch_idx, float(trainer.callback_metrics["batch"]), float(trainer.logged_metrics["batch"])]
            )

    trainer = Trainer(
        max_steps=8, default_root_dir=tmp_path, callbacks=[Reads()], **quiet(log_every_n_steps=2)
    )
    trainer.fit(LogsBatch(), regression_loader())
    assert seen == [[i, float(i), float(i)] for i in range(4)]
    assert read_metrics(tmp_path, "batch") == {4: 1.0, 8: 3.0}  # rows at the optimizer steps done (README)


def test_the_learning_rate_monitor_logs_the_first_of_several_optimizers(tmp_path):
    class Grouped(TwoHeads):
        def configure_optimizers(self):
            groups = [{"params": [self.b.weight], "lr": 0.2}, {"params": [self.b.bias], "lr": 0.3}]
            return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(groups)]

    monitor = LearningRateMonitor(logging_interval="step")
    trainer = Trainer(max_steps=4, default_root_dir=tmp_path, callbacks=[monitor], **quiet())
    trainer.fit(Grouped(), regression_loader())
    assert trainer.logged_metrics["lr/group0"] == 0.1 and "lr/group1" not in trainer.logged_metrics
