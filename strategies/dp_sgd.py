"""DPSGDStrategy: differentially private SGD (Abadi et al. 2016) over data-parallel CPU/GPU processes.

Each step: a Poisson-sampled logical batch (strategies/privacy/poisson_data.py), cut into physical chunks
of at most `max_physical_batch_size`; for each chunk the user's `training_step` runs as usual and its
backward yields per-sample gradients (strategies/privacy/per_sample.py), each clipped to `max_grad_norm` and
summed. The ranks' sums are all-reduced, Gaussian noise of std `noise_multiplier * max_grad_norm` is added once (the same
draw on every rank, so the replicas stay equal and 2 processes equal 1), and the result is divided by the
expected logical batch size. The accountant (strategies/privacy/accounting.py) counts every step; its history
is saved in checkpoints, so a resumed run — also at another world size, hence another sample rate — keeps
counting, and `target_epsilon` stops the run, with a checkpoint, before a step would exceed it.

The noise and the sampling come from `noise_seed`: drawn from the OS when not given, and stored in
checkpoints so that a resumed run continues the same streams. A checkpoint is therefore as sensitive as
the training data; release only the trained weights.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from strategies.mesh import MeshStrategy
from strategies.privacy.accounting import PrivacyAccountant, compute_epsilon
from strategies.privacy.calibration import find_noise_multiplier
from strategies.privacy.per_sample import CLIPPINGS, MODES, PerSampleGradients
from strategies.privacy.poisson_data import batch_length, poisson_loader, split_batch
from strategies.step_output import StepOutput, unpack_loss
from trainer import flags
from trainer.core.logging import rank_zero_info
from trainer.data.distributed import shard_loader

__all__ = ["DPSGDStrategy", "compute_epsilon", "find_noise_multiplier"]  # the accountants, public here too


class DPSGDStrategy(MeshStrategy):
    """Private training: per-sample clipping, calibrated noise, Poisson sampling and accounting.

    Give `noise_multiplier`, or `target_epsilon` with the run's length (`epochs` or `steps`) to calibrate
    it; with both, `target_epsilon` is a hard budget. `clipping` "flat" bounds each sample's whole
    gradient by `max_grad_norm`, "per_layer" each layer's by max_grad_norm/sqrt(layers). `grad_sample_mode`
    says how Linear/Embedding/Conv weights' per-sample norms are computed, all exactly: "mixed" (default)
    per layer the cheaper of Gram matrices (ghost clipping) and per-sample gradients, "ghost" always Gram
    matrices, "hooks" always per-sample gradients (strategies/privacy/per_sample.py).
    `loss_reduction` says what `training_step` returns: the "mean" or the "sum" of its samples' losses.
    A step that returns {"loss", "num_tokens"} (a token mean, as CausalLM's) is back-propagated as its
    token sum, so each sample's gradient is that of its own tokens' loss, independent of the others.
    """

    name = "dp_sgd"

    def __init__(
        self,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float = 1e-5,
        max_grad_norm: float = 1.0,
        epochs: int | None = None,
        steps: int | None = None,
        poisson_sampling: bool = True,
        clipping: str = "flat",
        grad_sample_mode: str = "mixed",
        accountant: str = "rdp",
        max_physical_batch_size: int | None = None,
        loss_reduction: str = "mean",
        noise_seed: int | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(timeout_s=timeout_s)
        if noise_multiplier is None and target_epsilon is None:
            raise ValueError("DPSGDStrategy needs noise_multiplier or target_epsilon; got neither")
        if noise_multiplier is not None:
            flags.check_number("noise_multiplier", noise_multiplier, 0)
            if noise_multiplier == 0 and target_epsilon is not None:
                raise ValueError(
                    "noise_multiplier=0 spends an infinite epsilon, so no target_epsilon can hold; allowed: "
                    "noise_multiplier > 0 with a budget (0 only to debug, without target_epsilon)"
                )
        if target_epsilon is not None:
            flags.check_number("target_epsilon", target_epsilon, 0, strict=True)
        if noise_multiplier is None and (epochs is None) == (steps is None):
            raise ValueError(
                "target_epsilon without noise_multiplier needs the run's length to calibrate the noise; "
                "allowed: exactly one of epochs=, steps="
            )
        if not isinstance(delta, float) or not 0 < delta < 1:
            raise ValueError(
                f"delta={delta!r} is invalid; allowed: a float in (0, 1), e.g. 1e-5 (below 1/dataset size)"
            )
        flags.check_number("max_grad_norm", max_grad_norm, 0, strict=True)
        self.epochs = flags.check_int("epochs", epochs, 1, allow_none=True)
        self.steps = flags.check_int("steps", steps, 1, allow_none=True)
        self.clipping = flags.check_choice("clipping", clipping, CLIPPINGS)
        self.grad_sample_mode = flags.check_choice("grad_sample_mode", grad_sample_mode, MODES)
        self.loss_reduction = flags.check_choice("loss_reduction", loss_reduction, ("mean", "sum"))
        self.max_physical_batch_size = flags.check_int(
            "max_physical_batch_size", max_physical_batch_size, 1, allow_none=True
        )
        self.noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.target_epsilon = None if target_epsilon is None else float(target_epsilon)
        self.delta, self.max_grad_norm = delta, float(max_grad_norm)
        self.poisson_sampling = bool(poisson_sampling)
        self.accountant = PrivacyAccountant(flags.check_choice("accountant", accountant, ("rdp", "prv")))
        self.noise_seed = noise_seed if noise_seed is None else flags.check_int("noise_seed", noise_seed, 0)
        self.sample_rate: float | None = None  # q, known once the train loader is seen
        self.expected_batch_size: int | None = None
        self.dp_steps = 0  # noised steps taken (the noise stream's position)
        self._engine: PerSampleGradients | None = None
        self._params: list[nn.Parameter] = []
        self._sums: list[torch.Tensor] = []
        self._step_stats: dict[str, float] = {}
        self._affordable: int | None = None  # steps the budget still allows, computed once per fit
        self._sampler: Any = None  # the Poisson batch sampler of the fit's train loader

    # ---- checks ----------------------------------------------------------------------------------
    def check_configuration(self) -> None:
        if self.precision.name == "16-mixed":
            raise ValueError(
                "precision='16-mixed' scales the loss, so per-sample norms would be scaled too; allowed with "
                "DPSGDStrategy: '32', 'bf16-mixed', 'bf16-true'"
            )
        if self.compile or self.activation_checkpointing:
            raise ValueError(
                f"compile={self.compile!r}, activation_checkpointing={self.activation_checkpointing!r}: DPSGDStrategy "
                "reads each layer's inputs and output gradients through hooks; allowed: compile=False, "
                "activation_checkpointing=None"
            )
        super().check_configuration()

    def check_module(self, module: nn.Module) -> None:
        """BatchNorm and layers whose per-sample gradients cannot be computed, and manual optimization, are
        named before training."""
        if not getattr(module, "automatic_optimization", True):
            raise ValueError(
                f"{type(module).__name__} optimizes manually, but DPSGDStrategy computes, clips and noises "
                "per-sample gradients in its own step; allowed with DPSGDStrategy: automatic optimization"
            )
        PerSampleGradients(module, "sum", self.grad_sample_mode, self.clipping)

    # ---- set-up ----------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.noise_seed is None:  # secret, the same on every rank
            self.noise_seed = self.broadcast_object(secrets.randbits(62))

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        if self.world_size > 1:  # every replica starts from rank 0's weights (no DDP wrapper does it here)
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0, group=self.mesh.group("world"))
        self._engine = PerSampleGradients(module, "sum", self.grad_sample_mode, self.clipping)
        self._params = list(self._engine.params)
        self._affordable = None
        return module

    def backward(self, loss: torch.Tensor) -> None:
        """A chunk's backward, only as far as its per-sample gradients need (no batch gradient: with
        16-mixed refused there is no loss scaler to apply)."""
        self._engine.backward(loss)

    def process_dataloader(self, loader: Iterable, seed: int, train: bool = True) -> Iterable:
        """Training: Poisson-sampled logical batches (or the usual shards without poisson_sampling), with
        the sample rate q = batch_size x processes / dataset size; evaluation: the usual shards."""
        if not train:
            return super().process_dataloader(loader, seed, train)
        dataset, batch_size = getattr(loader, "dataset", None), getattr(loader, "batch_size", None)
        if (
            not isinstance(batch_size, int)
            or not hasattr(dataset, "__len__")
            or not hasattr(dataset, "__getitem__")
        ):
            raise ValueError(
                "DPSGDStrategy samples from a map-style dataset: allowed: a DataLoader (or TokenLoader) with an int "
                f"batch_size over a dataset with len() and [i]; got {type(loader).__name__}"
            )
        n = len(dataset)
        if self.poisson_sampling:
            loader, q, expected = poisson_loader(loader, self.dp_size, self.dp_rank, self.noise_seed)
            self._sampler = loader.batch_sampler
        else:
            q, expected = min(1.0, batch_size * self.dp_size / n), batch_size * self.dp_size
            loader = shard_loader(loader, self.dp_rank, self.dp_size, seed)
        self.sample_rate, self.expected_batch_size = q, expected
        if self.noise_multiplier is None:
            steps = self.steps if self.steps is not None else self.epochs * max(1, round(1 / q))
            self.noise_multiplier = find_noise_multiplier(
                self.target_epsilon, q, steps, self.delta, self.accountant.kind
            )
            rank_zero_info(
                f"DP-SGD: noise_multiplier {self.noise_multiplier:.4f} spends epsilon {self.target_epsilon} "
                f"(delta {self.delta}) in {steps} steps at sample rate {q:.4g}"
            )
        return loader

    def watch_local_gradients(self, record: Callable[[torch.Tensor], None]) -> str:
        """Refused: the gradient DP-SGD steps on is made of per-sample gradients clipped to max_grad_norm,
        plus noise; its norms measure the clipping and the noise, not the data's gradient noise."""
        raise ValueError(
            "DPSGDStrategy clips every per-sample gradient and adds noise, so no rank ever holds the batch's "
            "true gradient to measure; allowed: DDPStrategy, or one process with accumulation"
        )

    # ---- the step: Opacus's DPOptimizer.pre_step as three named steps -----------------------------
    def train_step(
        self, module: nn.Module, micro_batches: list[Any], first_batch_idx: int
    ) -> StepOutput | None:
        """Step 1 over this rank's share of the logical batch, chunk by chunk (`max_physical_batch_size`)."""
        if len(micro_batches) != 1:
            raise ValueError(
                f"DPSGDStrategy got accumulate_grad_batches={len(micro_batches)}; allowed: 1 (a logical batch "
                "larger than memory is split by max_physical_batch_size instead, keeping the privacy analysis)"
            )
        batch = self.batch_to_device(micro_batches[0])
        n = batch_length(batch)
        self._sums = [torch.zeros_like(p, dtype=torch.float32) for p in self._params]
        loss_sum, weight, norms = torch.zeros((), device=self.root_device), 0.0, []
        for chunk in split_batch(batch, self.max_physical_batch_size or n) if n else []:
            chunk_loss, chunk_weight, chunk_norms = self._clip_and_accumulate(module, chunk, first_batch_idx)
            loss_sum += chunk_loss
            weight += chunk_weight
            norms.append(chunk_norms)
        norms_all = torch.cat(norms) if norms else torch.zeros(0, device=self.root_device)
        self._step_stats = {
            "samples": float(n),
            "clipped": float((norms_all > self.max_grad_norm).sum()),
        }
        mean_loss = loss_sum / weight if weight else loss_sum
        return StepOutput(mean_loss, torch.tensor(weight, device=self.root_device))

    def finish_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer, num_tokens: Any) -> None:
        """Steps 2 and 3: `.grad` = (sum over ranks of the clipped sums + N(0, (sigma*C)^2)) / batch size."""
        flat, samples, clipped = self._summed_over_ranks()
        flat = self._add_noise(flat)
        self._scale_into_grads(flat, samples)
        self._step_stats = {"samples": samples, "clipped_fraction": clipped / samples if samples else 0.0}

    def _clip_and_accumulate(
        self, module: nn.Module, chunk: Any, batch_idx: int
    ) -> tuple[torch.Tensor, float, torch.Tensor]:
        """Step 1, one chunk: the per-sample gradients, each clipped to `max_grad_norm`, summed into
        `_sums`. Returns (its weighted loss sum, its weight, the per-sample norms before clipping)."""
        with self._engine.capture():
            output = self.forward_step(module, chunk, batch_idx)
            if output is None:
                raise ValueError(
                    "training_step returned None under DPSGDStrategy; allowed: a loss (skipping a sampled "
                    "batch would change the privacy analysis)"
                )
            loss, num_tokens = unpack_loss(output, "training_step")
            size = batch_length(chunk)
            # the backward is of a sum over samples, so that each sample's gradient is its own alone
            # (a token mean would tie it to the others' token counts): a token loss as its token sum
            w = (
                float(num_tokens)
                if num_tokens is not None
                else size
                if self.loss_reduction == "mean"
                else 1.0
            )
            self.backward_step(module, loss, w)
        clipped = self._engine.clip_and_accumulate(self.max_grad_norm)
        for total, p in zip(self._sums, self._params, strict=True):
            total += clipped.grads[p].to(total.dtype)
        counted = w if num_tokens is not None or self.loss_reduction == "mean" else size
        return loss.detach().float() * w, counted, clipped.norms.detach()

    def _summed_over_ranks(self) -> tuple[torch.Tensor, float, float]:
        """(the clipped sums of every rank, flattened; the samples and the clipped samples of the step)."""
        flat = torch.cat([s.flatten() for s in self._sums]) if self._sums else torch.zeros(0)
        stats = torch.tensor([self._step_stats["samples"], self._step_stats["clipped"]], device=flat.device)
        if self.dp_size > 1:
            flat = self.reduce(flat, "sum", group="batch")
            stats = self.reduce(stats, "sum", group="batch")
        self._sums = []
        return flat, float(stats[0]), float(stats[1])

    def _add_noise(self, flat: torch.Tensor) -> torch.Tensor:
        """Step 2: Gaussian noise of std sigma x C, once for the whole batch, the same draw on every rank."""
        generator = torch.Generator(device=flat.device).manual_seed(
            (self.noise_seed * 1_000_003 + self.dp_steps) % 2**63
        )
        std = self.noise_multiplier * self.max_grad_norm
        if not std:
            return flat
        return flat + torch.normal(0.0, std, flat.shape, generator=generator, device=flat.device)

    def _scale_into_grads(self, flat: torch.Tensor, samples: float) -> None:
        """Step 3: divide by the expected batch size (Poisson) or the samples drawn, into each `.grad`."""
        denominator = self.expected_batch_size if self.poisson_sampling else max(samples, 1.0)
        flat = flat / denominator
        offset = 0
        for p in self._params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()

    def clip_gradients(
        self, params: list[nn.Parameter], max_value: float, algorithm: str, norm: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise ValueError(
            "gradient_clip_val does not apply under DPSGDStrategy (clipping after the noise would change "
            "nothing private); allowed: gradient_clip_val=None, and max_grad_norm= on the strategy"
        )

    def after_optimizer_step(self) -> None:
        super().after_optimizer_step()  # a MoE's bias balancing, as under every strategy
        if self.noise_multiplier > 0:  # without noise there is no guarantee to count (epsilon is infinite)
            self.accountant.step(self.noise_multiplier, self.sample_rate)
        self.dp_steps += 1

    # ---- what the Trainer reads ------------------------------------------------------------------
    def step_metrics(self) -> dict[str, float]:
        return {
            "privacy/epsilon": self.accountant.epsilon(self.delta) if self.noise_multiplier > 0 else math.inf,
            "privacy/noise_multiplier": self.noise_multiplier,
            "privacy/sample_rate": self.sample_rate,
            "privacy/batch_size": self._step_stats.get("samples", 0.0),
            "privacy/clipped_fraction": self._step_stats.get("clipped_fraction", 0.0),
        }

    def stop_reason(self) -> str | None:
        """Why training must stop now: the next step would spend more than `target_epsilon`."""
        if self.target_epsilon is None or self.sample_rate is None:
            return None
        if self._affordable is None:
            self._affordable = self.accountant.steps + self._steps_within_budget()
        if self.accountant.steps < self._affordable:
            return None
        spent = self.accountant.epsilon(self.delta) if self.accountant.steps else 0.0
        return (
            f"privacy budget: epsilon {spent:.3f} spent of target_epsilon {self.target_epsilon} (delta "
            f"{self.delta}); one more step would exceed it"
        )

    def _steps_within_budget(self) -> int:
        """The most further steps at (noise_multiplier, sample_rate) that keep epsilon <= target."""

        def fits(k: int) -> bool:
            eps = self.accountant.epsilon_after(k, self.noise_multiplier, self.sample_rate, self.delta)
            return eps <= self.target_epsilon

        if not fits(1):
            return 0
        lo, hi = 1, 2
        while fits(hi):
            lo, hi = hi, hi * 2
            if hi > 10**9:
                return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def state_dict(self) -> dict[str, Any]:
        return {
            "accountant": self.accountant.state_dict(),
            "noise_seed": self.noise_seed,
            "dp_steps": self.dp_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.accountant.load_state_dict(state["accountant"])
        self.noise_seed, self.dp_steps = state["noise_seed"], state["dp_steps"]
        if self._sampler is not None:  # the loader was built before the checkpoint was read
            self._sampler.seed = self.noise_seed
        self._affordable = None

    def teardown(self) -> None:
        super().teardown()
        self._sums = []
        if self._engine is not None:
            self._engine.clear()
