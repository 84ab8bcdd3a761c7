"""When a fit stops: the limits (max_steps, max_epochs), Lightning's should_stop behind min_steps/min_epochs,
and the stop reasons from outside (a signal, max_time, the strategy's spent budget) polled between steps,
each saving where it stopped when a resume could go on from there. A part of `FitLoop`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from trainer.core.logging import rank_zero_info
from trainer.loop.stop_signals import NAMES, StoppedBySignal

if TYPE_CHECKING:
    from trainer.loop.stop_signals import StopSignals
    from trainer.loop.time_limit import TimeLimit
    from trainer.trainer import Trainer


class StopConditions:
    """FitLoop's stop conditions; it sets the attributes named here when a fit starts."""

    trainer: Trainer
    must_stop: bool
    signals: StopSignals
    time_limit: TimeLimit | None
    started: float
    start_step: int
    stopped_by: int | None
    stop_checkpoint: object

    @property
    def done(self) -> bool:
        """Whether the fit stops before the next step: max_steps, max_epochs, a stop that must be obeyed
        (`stop_now`), or should_stop once min_steps and min_epochs are met, as Lightning's `done` (pure: the
        stop reasons that come from outside, with the checkpoint they save, are `poll_stops`')."""
        trainer = self.trainer
        s, flags = trainer.state, trainer.flags  # (the flags read once: this runs before every step)
        return (
            self.must_stop
            or (flags.max_steps is not None and s.global_step >= flags.max_steps)
            or (flags.max_epochs is not None and s.epoch >= flags.max_epochs)
            or (trainer.should_stop and self.can_stop_early)
        )

    @property
    def can_stop_early(self) -> bool:
        """Lightning's `_can_stop_early`: min_epochs epochs done and min_steps steps taken (min_steps alone
        also asks for one whole epoch, as Lightning's loop limits do)."""
        trainer, s = self.trainer, self.trainer.state
        min_epochs = trainer.min_epochs
        if min_epochs is None and trainer.min_steps is not None:
            min_epochs = 1
        return s.epoch >= (min_epochs or 0) and s.global_step >= (trainer.min_steps or 0)

    def stop_now(self) -> None:
        """End the fit before the next step, whatever min_steps/min_epochs say: a signal, max_time, a spent
        budget, a `save_and_stop` (each has said or saved where it stopped)."""
        self.must_stop = True
        self.trainer.should_stop = True

    def _goes_on(self) -> bool:
        """Before each step (and each epoch): the outside stop reasons polled, then whether the fit goes on."""
        self.poll_stops()
        trainer, done = self.trainer, self.done
        if trainer.should_stop and not done:
            why = f"min_epochs={trainer.min_epochs}, min_steps={trainer.min_steps} not met"
            trainer.say_once("min_steps", f"should_stop was set but {why}: training goes on, as in Lightning")
        return not done

    def poll_stops(self) -> None:
        """Between steps, where a checkpoint may be written: a Ctrl-C or SIGTERM, max_time or the strategy's
        stop reason (a spent privacy budget), agreed by every rank (each calls it as often), set `should_stop`,
        saving the last step first when a resume could go on from it."""
        trainer = self.trainer
        if self.must_stop or (trainer.should_stop and self.can_stop_early):
            return  # decided: nothing more to poll (every rank knows it at the same step)
        s, strategy = trainer.state, trainer.strategy
        if number := self.signals.agreed(strategy.world_size):
            self._stop_for_signal(number)
            return
        # every rank must stop at the same step: their clocks agree at steps they all know (time_limit.py)
        if self.time_limit is not None and self.time_limit.reached(
            s.global_step, time.time() - self.started, self._slowest
        ):
            self.stop_now()
            rank_zero_info(f"stopping at step {s.global_step}: max_time of {trainer.max_time:.0f} s reached")
            return
        reason = strategy.stop_reason()
        if reason is not None:
            if s.global_step > self.start_step:  # this fit trained: keep where it stopped
                trainer.save_and_stop(reason, resumable=False)
            else:
                self.stop_now()
                rank_zero_info(f"stopping at step {s.global_step} before training: {reason}")

    def _stop_for_signal(self, number: int) -> None:
        """Every rank had a signal's word: a checkpoint of the last step when this fit trained one, then stop."""
        self.stopped_by = number
        if self.trainer.global_step > self.start_step:
            self.stop_checkpoint = self.trainer._save_for_stop()
        self.stop_now()

    def signal_exit(self) -> StoppedBySignal:
        """The fit's last line after a signal stopped it, and the exit that follows (128 + the signal)."""
        step, name, hint = self.trainer.global_step, NAMES[self.stopped_by], self.trainer.resume_hint
        if self.stop_checkpoint is None:
            rank_zero_info(f"stopped at step {step} ({name}) before training a step; nothing new to save")
        else:
            rank_zero_info(
                f"stopped at step {step} ({name}): checkpoint {self.stop_checkpoint}; resume with {hint}"
            )
        return StoppedBySignal(self.stopped_by)

    def _slowest(self, elapsed: float) -> float:
        """The largest of the ranks' `elapsed` (every rank calls it)."""
        mine = torch.tensor(elapsed, dtype=torch.float64)
        return float(self.trainer.strategy.reduce(mine, "max", group="world"))
