"""The learning-rate range test's parts (Lightning's `tuner/lr_finder.py`): the schedule that raises the LR
step by step, the callback that records each step's LR and smoothed loss and stops the sweep when the loss
diverges, and `LRFinder`, the results with the suggestion of the steepest descent."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from trainer.core.logging import log

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer

MODES = ("linear", "exponential")


class SweepLR(torch.optim.lr_scheduler.LRScheduler):
    """From each group's base LR (the sweep's `min_lr`) towards `end_lr` over `num_iter` steps, linearly or
    exponentially, indexed as Lightning's `_LinearLR`/`_ExponentialLR`: the first step at the base LR, step
    k >= 1 at the fraction (k + 1) / num_iter of the way. `lr` is the list last computed."""

    def __init__(self, optimizer: torch.optim.Optimizer, end_lr: float, num_iter: int, mode: str) -> None:
        self.end_lr, self.num_iter, self.exponential = end_lr, num_iter, mode == "exponential"
        self.lr: list[float] = []
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        r = (self.last_epoch + 1) / self.num_iter
        if self.last_epoch <= 0:
            self.lr = list(self.base_lrs)
        elif self.exponential:
            self.lr = [base * (self.end_lr / base) ** r for base in self.base_lrs]
        else:
            self.lr = [base + r * (self.end_lr - base) for base in self.base_lrs]
        return self.lr


class SweepRecorder(Callback):
    """Before each step the LR it uses; after it the loss smoothed as Lightning's `_LRCallback` does (an
    exponential average with `beta`, bias-corrected by the step count), and `should_stop` once that exceeds
    `early_stop_threshold` x the best so far (after the first step). A step that returned no loss records nan."""

    def __init__(self, early_stop_threshold: float | None, beta: float = 0.98) -> None:
        self.early_stop_threshold, self.beta = early_stop_threshold, beta
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.avg_loss = 0.0
        self.best_loss = 0.0

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        self.lrs.append(trainer.lr_scheduler.lr[0])

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        if outputs.get("loss") is None:
            # nan keeps the lists aligned; the suggestion leaves non-finite losses out
            self.losses.append(float("nan"))
            return
        step = trainer.global_step
        self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * outputs["loss"].item()
        smoothed = self.avg_loss / (1 - self.beta ** (step + 1))
        threshold = self.early_stop_threshold
        diverged = threshold is not None and step > 1 and smoothed > threshold * self.best_loss
        # every rank stops where rank zero does, as Lightning broadcasts it
        trainer.should_stop = trainer.strategy.broadcast_object(trainer.should_stop or diverged)
        if smoothed < self.best_loss or step == 1:
            self.best_loss = smoothed
        self.losses.append(smoothed)


class LRFinder:
    """The results of a range test (Lightning's `_LRFinder`): `results["lr"]` and `results["loss"]` per step,
    `suggestion()` and `plot()`."""

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is invalid; allowed: {', '.join(map(repr, MODES))}")
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results: dict[str, list[float]] = {}
        self._optimal_idx: int | None = None

    def scheduler(self, optimizer: torch.optim.Optimizer) -> SweepLR:
        """The sweep's schedule on `optimizer`, every group starting at `lr_min` (Lightning's
        `_exchange_scheduler`)."""
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = self.lr_min
        return SweepLR(optimizer, self.lr_max, self.num_training, self.mode)

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The LR of the steepest descent of the loss over the LR (torch.gradient over the finite points left
        after skipping `skip_begin` and `skip_end`), or None with fewer than two such points."""
        losses = torch.tensor(self.results["loss"][skip_begin:-skip_end])
        lrs = torch.tensor(self.results["lr"][skip_begin:-skip_end])
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        if len(losses) < 2:
            log.error(
                "Failed to compute suggestion for learning rate because there are not enough points. Increase the "
                "loop iteration limits or the size of your dataset/dataloader."
            )
            self._optimal_idx = None
            return None
        gradients = torch.gradient(losses, spacing=[lrs])[0]
        kept = torch.arange(len(self.results["loss"]))[skip_begin:-skip_end][finite]
        self._optimal_idx = int(kept[torch.argmin(gradients)])
        return self.results["lr"][self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """The loss over the LR (log scale for an exponential sweep), the suggestion marked in red with
        `suggest`; matplotlib's figure."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise ImportError("LRFinder.plot needs matplotlib: pip install matplotlib") from err
        if ax is None:
            fig, ax = plt.subplots()
        else:
            fig = ax.figure
        lrs, losses = self.results["lr"], self.results["loss"]
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None:
            idx = self._optimal_idx
            ax.plot(lrs[idx], losses[idx], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return fig
