"""GradientNoiseScale: the simple noise scale B_simple = tr(Sigma) / |G|^2 of McCandlish et al. 2018 ("An
Empirical Model of Large-Batch Training", arXiv:1812.06162), measured while the run trains.

Sigma is the covariance of one example's gradient and G the true gradient. A batch of B examples has a
gradient G_B with E|G_B|^2 = |G|^2 + tr(Sigma) / B, so two batch sizes B_small < B_big give, per step
(their Appendix A.1), unbiased estimates

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

each averaged over steps with an exponential moving average before their ratio is taken (the ratio of
noisy estimates is biased). B_simple is the batch size beyond which a larger batch mostly buys a
cleaner gradient rather than fewer steps (`trainer plan --noise-scale`).

The two norms come from gradients the run already has, at no extra forward or backward:
- under data parallelism (DDP, ZeRO-1): this rank's gradient, read by a comm hook before the all-reduce
  (B_small = the rank's batch), against the all-reduced one (B_big = the global batch);
- under gradient accumulation on one process: the first micro-batch's gradient, read from `.grad` when
  the second micro-batch's backward begins (B_small = a micro-batch), against the step's.
Batch sizes count samples (rows of the batches the loader yields). The weight a micro-batch's loss
enters the backward with (1/accumulation, its token count for token-weighted losses, fp16's loss scale)
is read from the gradient that reaches the first micro-batch's loss, so `.grad` can be put in the units
of a mean gradient; token-weighted losses are assumed to hold equal token counts per micro-batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class GradientNoiseScale(Callback):
    """Logs `noise_scale` (B_simple, in samples) with its parts `noise_scale/tr_sigma` and
    `noise_scale/grad_sq`, and the two batch sizes compared, every `log_every_n_steps` (None: the
    Trainer's). `ema_decay` weighs past steps in the moving averages of both parts."""

    def __init__(self, ema_decay: float = 0.99, log_every_n_steps: int | None = None) -> None:
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay={ema_decay!r} is invalid; allowed: 0 <= ema_decay < 1")
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} is invalid; allowed: None or >= 1")
        self.ema_decay, self.log_every_n_steps = ema_decay, log_every_n_steps
        self.mode: str | None = None  # "sync" or "micro-batches": where this rank's own gradient is read
        # moving sums of (tr(Sigma), |G|^2) and of the weights they carry (the ratio of the two: their mean)
        self._sums = torch.zeros(2, dtype=torch.float64)
        self._weight = torch.zeros((), dtype=torch.float64)
        self._batches = (0.0, 0.0)  # (B_small, B_big) of the latest step
        # the step in progress
        self._samples_before = 0  # this rank's samples_seen before the step's micro-batches
        self._step_samples = 0  # this rank's samples in the step
        self._backwards = 0
        # the gradient that reached the first micro-batch's loss: the weight it entered the backward with
        self._loss_weight: torch.Tensor | None = None
        self._small_sq: torch.Tensor | None = None  # "micro-batches": |.grad|^2 after the first micro-batch
        self._buckets: list[torch.Tensor] = []  # "sync": each bucket's squared norm before the all-reduce

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if stage != "fit":
            return
        if not getattr(module, "automatic_optimization", True):
            raise ValueError(
                f"GradientNoiseScale reads the gradients of the Trainer's optimizer steps, but {type(module).__name__} "
                "optimizes manually (its backwards are its own); allowed: automatic_optimization=True"
            )
        self.mode = trainer.strategy.watch_local_gradients(self._buckets.append)
        if self.mode == "micro-batches" and trainer.accumulate_grad_batches < 2:
            raise ValueError(
                "GradientNoiseScale compares gradients of two batch sizes, but one process without gradient "
                "accumulation has only one (accumulate_grad_batches=1); allowed: accumulate_grad_batches >= 2, "
                "or DDPStrategy over 2 or more ranks"
            )

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        self._samples_before = trainer.state.samples_seen
        self._backwards, self._loss_weight, self._small_sq = 0, None, None
        self._buckets.clear()

    def on_before_backward(self, trainer: Trainer, module: TrainModule, loss: torch.Tensor) -> None:
        if self._backwards == 0:
            # the step's micro-batches are all counted before the first forward
            self._step_samples = trainer.state.samples_seen - self._samples_before
            if loss.requires_grad:
                loss.register_hook(self._take_loss_weight)
        elif self._backwards == 1 and self.mode == "micro-batches":
            strategy = trainer.strategy
            params = strategy.trained_parameters(trainer.optimizer)
            self._small_sq = strategy.grad_norm(params).double().square()
        self._backwards += 1

    def _take_loss_weight(self, grad: torch.Tensor) -> None:
        self._loss_weight = grad.detach().double()

    def on_before_optimizer_step(
        self, trainer: Trainer, module: TrainModule, optimizer: torch.optim.Optimizer
    ) -> None:
        small = self._small_gradient_sq()
        if small is None:
            return
        small_sq, b_small = small
        b_big = float(self._step_samples * trainer.strategy.dp_size)
        if not 0 < b_small < b_big:
            return
        # the step's gradient before clipping, the same on every rank
        big_sq = trainer.step_grad_norm().detach().double().square()
        grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        tr_sigma = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        parts = torch.stack([tr_sigma, grad_sq])
        if self._sums.device != parts.device:  # kept on the gradients' device: no host sync per step
            self._sums, self._weight = self._sums.to(parts.device), self._weight.to(parts.device)
        # a step with inf/nan gradients (fp16's skipped steps) leaves the averages as they were, without
        # asking the device whether it had one
        finite = torch.isfinite(parts).all().double()
        decay = self.ema_decay
        self._sums = torch.where(finite > 0, decay * self._sums + (1 - decay) * parts, self._sums)
        self._weight = self._weight + finite * (decay * self._weight + (1 - decay) - self._weight)
        self._batches = (b_small, b_big)

    def _small_gradient_sq(self) -> tuple[torch.Tensor, float] | None:
        """|G_small|^2 in the units of a mean gradient, and B_small; None when the step gave none."""
        weight = self._loss_weight
        if weight is None:
            return None
        if self.mode == "sync":
            if not self._buckets:
                return None
            # the buckets hold the sum of every micro-batch's weighted gradient: k times the first's weight
            local_sq = torch.stack(self._buckets).sum().double()
            return local_sq / (self._backwards * weight) ** 2, float(self._step_samples)
        if self._small_sq is None:
            return None
        return self._small_sq / weight**2, self._step_samples / self._backwards

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        every = self.log_every_n_steps or trainer.log_every_n_steps
        step = trainer.global_step
        if step % every and step != trainer.max_steps:
            return
        estimate = self.estimate(trainer)
        if estimate:
            trainer.log_metrics(estimate)

    def estimate(self, trainer: Trainer) -> dict[str, float]:
        """The current averages over the batch group (each rank measured its own G_small): tr(Sigma),
        |G|^2, their ratio B_simple when |G|^2 > 0, and the batch sizes. Call on every rank."""
        strategy = trainer.strategy
        local = torch.cat([self._sums, self._weight.reshape(1)]).to(strategy.root_device)
        tr_sigma, grad_sq, weight = strategy.reduce(local, "mean", group="batch").tolist()
        if weight <= 0:
            return {}
        tr_sigma, grad_sq = tr_sigma / weight, grad_sq / weight
        metrics = {
            "noise_scale/tr_sigma": tr_sigma,
            "noise_scale/grad_sq": grad_sq,
            "noise_scale/batch_small": self._batches[0],
            "noise_scale/batch_big": self._batches[1],
        }
        if grad_sq > 0:
            metrics["noise_scale"] = tr_sigma / grad_sq
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self._sums.tolist(), "weight": float(self._weight)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sums = torch.tensor(state["sums"], dtype=torch.float64)
        self._weight = torch.tensor(state["weight"], dtype=torch.float64)
