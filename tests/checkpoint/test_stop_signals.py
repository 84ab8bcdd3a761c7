"""Ctrl-C and SIGTERM with no callback asked for: the step in flight finishes, a resumable checkpoint is
saved, one line says where and how to resume, the process exits 130 / 143, and the resumed run ends where
an uninterrupted one does. A second Ctrl-C aborts at once. The signals come from the module's own step
(os.kill of its own process), so the step they land in is known without any timing."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    SMALL,
    TIMING_SCRIPT,
    TINY,
    Regression,
    assert_params_close,
    checkpoint_steps,
    failure,
    launch_env,
    params,
    quiet,
    regression_loader,
    run_cli,
    run_script,
    start_process,
)
from helpers import script_result as result

from callbacks import ModelCheckpoint
from trainer import Trainer


class SignalledAt(Regression):
    """A regressor (SGD) whose process receives `signum` inside the training step of optimizer step
    `step` (1-based), `times` times, as a user's Ctrl-C or a scheduler's SIGTERM would land."""

    def __init__(self, signum: int | None = None, step: int = 0, times: int = 1) -> None:
        torch.manual_seed(0)  # every instance starts from the same weights
        super().__init__(optimizer="sgd", lr=0.05)
        self.signum, self.step, self.times = signum, step, times

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.signum is not None and self.trainer.global_step + 1 == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)
        return loss


@pytest.fixture(autouse=True)
def foreground():
    """SIGINT and SIGTERM as a terminal's foreground job has them (a shell's `&`, or a CI runner, may have
    started the tests with SIGINT ignored, which a fit rightly leaves alone); put back afterwards."""
    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for number, handler in before.items():
        signal.signal(number, handler)


def trainer(root, steps: int = 8, **kwargs) -> Trainer:
    return Trainer(max_steps=steps, seed=0, default_root_dir=root, **quiet(**kwargs))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_the_step_in_flight_exits_128_plus_it_and_the_run_resumes_exactly(
    tmp_path, caplog, signum
):
    straight = SignalledAt()
    trainer(tmp_path / "straight").fit(straight, regression_loader())

    module = SignalledAt(signum, step=3)
    root = tmp_path / "stopped"
    with caplog.at_level(logging.INFO, logger="trainer"), pytest.raises(SystemExit) as stop:
        trainer(root, callbacks=[ModelCheckpoint(every_n_steps=100)]).fit(module, regression_loader())
    assert stop.value.code == 128 + signum
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    last = caplog.records[-1].message
    assert last.startswith(f"stopped at step 3 ({name}): checkpoint ") and "step-00000003" in last, last
    assert last.endswith("resume with ckpt_path='last'"), last
    assert checkpoint_steps(root) == [3]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the fit's handlers are gone
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    resumed = SignalledAt()
    trainer(root).fit(resumed, regression_loader(), ckpt_path="last")
    assert_params_close(params(resumed), params(straight), atol=0)


def test_without_a_checkpoint_callback_the_stop_still_saves_one(tmp_path, caplog):
    root = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="trainer"), pytest.raises(SystemExit) as stop:
        trainer(root, enable_checkpointing=False).fit(
            SignalledAt(signal.SIGTERM, step=2), regression_loader()
        )
    assert stop.value.code == 143
    assert checkpoint_steps(root) == [2], "SIGTERM without ModelCheckpoint saved nothing"
    assert "stopped at step 2 (SIGTERM): checkpoint" in caplog.records[-1].message


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    module = SignalledAt(signal.SIGINT, step=2, times=2)
    with pytest.raises(KeyboardInterrupt):
        trainer(tmp_path / "run").fit(module, regression_loader())
    assert not (tmp_path / "run" / "checkpoints").exists() or checkpoint_steps(tmp_path / "run") == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_handler_of_the_users_keeps_its_signal(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: seen.append(number))
    try:
        trained = trainer(tmp_path / "run", steps=4).fit(
            SignalledAt(signal.SIGTERM, step=2), regression_loader()
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert trained is None and seen == [signal.SIGTERM]  # the fit ran to its end: the signal was the user's


def test_a_background_job_whose_ctrl_c_is_ignored_keeps_ignoring_it(tmp_path):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # `trainer fit ... &` from a shell: Ctrl-C is not for it
    module = SignalledAt(signal.SIGINT, step=2)
    trainer(tmp_path / "run", steps=4).fit(module, regression_loader())
    assert module.trainer.global_step == 4 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_non_finite_fit_without_a_checkpoint_callback_fails_in_one_line(tmp_path):
    from callbacks.checkpoint import ModelNotFiniteError

    class Diverges(Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if self.trainer.global_step >= 2 else loss

    with pytest.raises(ModelNotFiniteError) as err:
        trainer(tmp_path / "run", steps=5, enable_checkpointing=False).fit(
            Diverges(optimizer="sgd"), regression_loader()
        )
    assert str(err.value) == (
        "the fit ended with non-finite parameters (the loss was first non-finite in step 3); nothing it "
        "trained since is usable"
    )


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step_with_a_checkpoint(tmp_path, signame):
    # rank 1 alone receives it inside step 3; the ranks learn of it through the all-reduce started after
    # step 3 and read after step 4, so both stop at step 4
    args = ["--steps", "8", "--optimizer", "sgd", "--shuffle"]
    done, root = run_script(
        2, TIMING_SCRIPT, tmp_path, "stopped", *args, "--signal-at", f"1:3:{signame}", check=False
    )
    name = "Ctrl-C" if signame == "SIGINT" else "SIGTERM"
    assert done.returncode == 128 + getattr(signal, signame), failure(done.stderr)
    last = done.stderr.strip().splitlines()[-1]
    assert f"stopped at step 4 ({name}): checkpoint " in last and "resume with ckpt_path='last'" in last, last
    assert checkpoint_steps(root) == [4]
    run_script(2, TIMING_SCRIPT, tmp_path, "stopped", *args, "--resume")  # the same root: continue it
    run_script(2, TIMING_SCRIPT, tmp_path, "straight", *args)
    assert_params_close(result(tmp_path, "stopped")["params"], result(tmp_path, "straight")["params"], atol=0)


def test_a_fit_whose_last_loss_is_not_finite_fails_even_when_a_guard_kept_the_weights(tmp_path):
    from callbacks import NaNGuard
    from callbacks.checkpoint import ModelNotFiniteError

    class LastLossNaN(Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if self.trainer.global_step == 4 else loss

    module = LastLossNaN(optimizer="sgd")
    with pytest.raises(ModelNotFiniteError) as err:
        trainer(tmp_path / "run", steps=5, enable_checkpointing=False, callbacks=[NaNGuard()]).fit(
            module, regression_loader()
        )
    assert all(torch.isfinite(p).all() for p in module.parameters())  # NaNGuard skipped the update
    assert str(err.value).startswith(
        "the fit ended with a non-finite loss at its last step (the loss was first non-finite in step 5)"
    )


@pytest.mark.slow
def test_ctrl_c_on_trainer_fit_prints_one_line_and_the_command_resumes(tmp_path):
    common = [*SMALL, "trainer.val_check_interval=2"]
    cmd = [sys.executable, "-m", "trainer.cli", "fit", str(TINY), *common, "trainer.max_steps=400"]
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env(), cwd=tmp_path)
    proc = start_process(cmd, **popen)
    for line in proc.stderr:  # blocks on the pipe: the run is training once a validation is printed
        if "validation at step 2 " in line:
            break
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 130, rest[-3000:]
    assert "Traceback" not in rest, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    match = re.fullmatch(
        r"\[trainer\] stopped at step (\d+) \(Ctrl-C\): checkpoint (\S+); resume with --ckpt-path last", last
    )
    assert match, last
    step = int(match.group(1))
    assert Path(match.group(2)).name == f"step-{step:08d}"
    done = run_cli(
        "fit", str(TINY), *common, f"trainer.max_steps={step + 2}", "--ckpt-path", "last", cwd=tmp_path
    )
    assert done.returncode == 0, failure(done.stderr)
    assert f"step {step}" in done.stderr and "resuming from" in done.stderr
