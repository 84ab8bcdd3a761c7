"""NaNGuard: skip optimizer steps with a non-finite or spiking loss; roll back after too many in a row."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from callbacks.loss_window import LossWindow
from trainer import flags
from trainer.core.logging import log

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class NaNGuard(Callback):
    """Before each optimizer step, check the step's loss (over all ranks) and global gradient norm.

    - Non-finite loss or gradients: the update is skipped (parameters and optimizer state unchanged) and
      a warning says what was seen.
    - With `spike_factor`, a loss above `spike_factor` x the median of the last `window` good steps'
      losses is a spike: skipped too (or only warned about, `skip_spikes=False`). Spikes need
      `min_history` good steps first.
    - After `rollback_after` bad steps in a row, the run rolls back to the newest good checkpoint from
      before the first of them and reads on from where the data is (the batches in between are not
      replayed, as PaLM did); None keeps skipping. Skipped steps leave the parameters as they were, so
      this matters when the trouble began before the guard saw it (a divergence that turns into NaN):
      the LR schedule rewinds and the data moves past the batches that led there. After
      `max_rollbacks` rollbacks that did not help, the run fails with an error rather than loop.
    All ranks reach the same decision: one all-reduce of (loss, non-finite flag) per step, and the
    gradient norm is global already. Reading them back costs a device sync per step.
    """

    def __init__(
        self,
        rollback_after: int | None = 5,
        spike_factor: float | None = None,
        window: int = 100,
        min_history: int = 10,
        skip_spikes: bool = True,
        max_rollbacks: int = 3,
    ) -> None:
        flags.check_int("rollback_after", rollback_after, 1, allow_none=True)
        flags.check_number("spike_factor", spike_factor, 1, strict=True, allow_none=True)
        flags.check_int("window", window, 1)
        flags.check_int("min_history", min_history, 1)
        flags.check_int("max_rollbacks", max_rollbacks, 0)
        self.rollback_after, self.spike_factor, self.skip_spikes = rollback_after, spike_factor, skip_spikes
        self.max_rollbacks = max_rollbacks
        self.min_history = min_history
        self.history = LossWindow(window)
        self.bad_in_a_row = 0
        self.streak_start = 0  # global step of the first bad step in the current streak
        self.skipped = 0
        self.rollbacks = 0
        self.last_problem = ""

    def on_before_optimizer_step(
        self, trainer: Trainer, module: TrainModule, optimizer: torch.optim.Optimizer
    ) -> None:
        loss = trainer.step_loss.detach().float()
        norm = trainer.step_grad_norm().detach().float().to(loss.device)
        finite = torch.isfinite(loss)
        # the norm is global, but a rank's gradients can go bad after the sync (a faulty device): count
        # ranks, over the whole world, since every rank must take the same skip/rollback decision
        bad_loss, bad_norm = (~finite).float(), (~torch.isfinite(norm)).float()
        summed = trainer.strategy.reduce(
            torch.stack([torch.where(finite, loss, 0.0), bad_loss, bad_norm]), "sum", group="world"
        )
        total, bad_losses, bad_norms = summed.tolist()
        mean_loss = total / trainer.strategy.group_size("world")
        problem = None
        if bad_losses > 0:
            problem = f"loss is not finite on {int(bad_losses)} rank(s)"
        elif bad_norms > 0:
            problem = f"gradient norm is not finite on {int(bad_norms)} rank(s)"
        elif self.spike_factor is not None and len(self.history) >= self.min_history:
            median = self.history.median()
            if mean_loss > self.spike_factor * median:
                spike = (
                    f"loss {mean_loss:.4g} spiked above {self.spike_factor} x the running median {median:.4g}"
                )
                if self.skip_spikes:
                    problem = spike
                elif trainer.is_global_zero:
                    log.warning(f"NaNGuard: step {trainer.global_step + 1}: {spike}")
        if problem is None:
            self.bad_in_a_row = 0
            self.history.add(mean_loss)
            return
        if self.bad_in_a_row == 0:
            self.streak_start = trainer.global_step
        self.bad_in_a_row += 1
        self.skipped += 1
        self.last_problem = problem
        trainer.skip_optimizer_step(problem)
        if trainer.is_global_zero:
            log.warning(
                f"NaNGuard: step {trainer.global_step + 1}: {problem}; update skipped "
                f"({self.bad_in_a_row} bad step(s) in a row)"
            )
        trainer.log_metrics({"nan_guard/skipped_steps": self.skipped})

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        if self.rollback_after is None or self.bad_in_a_row < self.rollback_after:
            return
        if self.rollbacks >= self.max_rollbacks:
            raise RuntimeError(
                f"NaNGuard: {self.rollbacks} rollbacks did not help; {self.bad_in_a_row} bad steps in a row "
                f"again at step {trainer.global_step} ({self.last_problem}). Stopping: the run needs a look "
                "(learning rate, data, precision)"
            )
        bad, self.bad_in_a_row = self.bad_in_a_row, 0
        at = trainer.global_step
        path = trainer.rollback(before_step=self.streak_start + 1)
        self.rollbacks += 1
        if trainer.is_global_zero:
            log.warning(
                f"NaNGuard: {bad} bad steps in a row at step {at}: rolled back to {path.name}; training goes on "
                "with the data that follows (the batches in between are skipped)"
            )
        trainer.log_metrics({"nan_guard/rollbacks": self.rollbacks})

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history.state_dict(), "skipped": self.skipped, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # what `state_dict` returned (the Trainer loads only a checkpoint's own NaNGuard entry): all three keys
        self.history.load_state_dict(state["history"])
        self.skipped, self.rollbacks = state["skipped"], state["rollbacks"]
