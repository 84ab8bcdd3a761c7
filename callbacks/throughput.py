"""ThroughputMonitor: tokens/s, samples/s and model FLOP/s per device, and MFU on a GPU with a known peak."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from callbacks.mfu import model_flops_per_token, peak_flops
from trainer import flags
from trainer.core.logging import rank_zero_info

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class ThroughputMonitor(Callback):
    """Every `log_every_n_steps` optimizer steps (default: the Trainer's), logs the rates of one device:

    - `throughput/tokens_per_s_per_device`, `throughput/samples_per_s_per_device`;
    - `throughput/flops_per_s_per_device`: achieved model FLOP/s, when FLOPs per token are known
      (`flops_per_token`, else the module's `flops_per_token(seq_len)` at the first batch's length);
    - `throughput/mfu`: that over the GPU's dense BF16 peak (callbacks.mfu), on a GPU in the table.

    Rates come from this rank's token and sample counts over wall-clock time (validation and other
    callbacks' reported stalls, such as the Profiler writing a trace, left out),
    divided by the ranks that share one data-parallel replica's batch (tensor/pipeline parallel), then
    averaged over ranks. Tokens are counted when batches carry `input_ids` (see Trainer).
    """

    def __init__(self, log_every_n_steps: int | None = None, flops_per_token: float | None = None) -> None:
        flags.check_int("log_every_n_steps", log_every_n_steps, 1, allow_none=True)
        flags.check_number("flops_per_token", flops_per_token, 0, strict=True, allow_none=True)
        self.log_every_n_steps = log_every_n_steps
        self.flops_per_token = float(flops_per_token) if flops_per_token is not None else None
        self._peak: float | None = None
        self._flops: float | None = None
        self._flops_resolved = False
        self._since = 0.0
        self._tokens = self._samples = 0
        self._excluded_s = self._stalls = 0.0
        self._val_started: float | None = None

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        device = trainer.strategy.root_device
        self._peak = peak_flops(device)
        if self._peak is None:
            rank_zero_info(
                f"ThroughputMonitor: no MFU, {no_peak_reason(device)}; logging achieved FLOP/s only"
            )
        self._flops_resolved = False
        self._restart(trainer)

    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._val_started = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._val_started is not None:  # validation is not training throughput
            self._excluded_s += time.perf_counter() - self._val_started
            self._val_started = None

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        every = self.log_every_n_steps or trainer.log_every_n_steps
        step = trainer.global_step
        if step % every and step != trainer.max_steps:
            return
        if not self._flops_resolved:
            self._flops = self.flops_per_token or flops_per_token_of(trainer, module, "ThroughputMonitor")
            self._flops_resolved = True
        strategy = trainer.strategy
        stalls = _stall_s(trainer)
        elapsed = max(time.perf_counter() - self._since - self._excluded_s - (stalls - self._stalls), 1e-9)
        share = elapsed * ranks_per_replica(trainer)
        state = trainer.state
        tokens_per_s = (state.tokens_seen - self._tokens) / share
        local = torch.tensor(
            [tokens_per_s, (state.samples_seen - self._samples) / share, tokens_per_s * (self._flops or 0.0)],
            dtype=torch.float64,
            device=strategy.root_device,
        )
        # every rank ran the same steps: the mean over the world is the per-device rate
        tokens, samples, flops = strategy.reduce(local, "mean", group="world").tolist()
        metrics = {"throughput/samples_per_s_per_device": samples}
        if tokens > 0:
            metrics["throughput/tokens_per_s_per_device"] = tokens
            if self._flops is not None:
                metrics["throughput/flops_per_s_per_device"] = flops
                if self._peak is not None:
                    metrics["throughput/mfu"] = flops / self._peak
        trainer.log_metrics(metrics)
        self._restart(trainer)

    def _restart(self, trainer: Trainer) -> None:
        self._tokens, self._samples = trainer.state.tokens_seen, trainer.state.samples_seen
        self._excluded_s, self._stalls, self._since = 0.0, _stall_s(trainer), time.perf_counter()


def _stall_s(trainer: Trainer) -> float:
    """Seconds other callbacks held the loop for their own work (the Profiler writing traces), which
    is not training time; a callback reports them as a `stall_s` attribute."""
    return sum(getattr(cb, "stall_s", 0.0) for cb in trainer.callbacks)


def ranks_per_replica(trainer: Trainer) -> int:
    """Ranks that consume the same data-parallel shard (tensor/pipeline/context parallel): each counts
    the replica's tokens, so per-device rates divide by them."""
    return trainer.strategy.group_size("world") // trainer.strategy.group_size("batch")


def sequence_length(batch: Any) -> int | None:
    """The sequence length of a token batch: `input_ids` of a dict, or a 2-D integer tensor as the batch
    or its first element; None for other batches."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if ids is None and not isinstance(batch, dict):
        ids = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
        return int(ids.shape[1])
    return None


def flops_per_token_of(trainer: Trainer, module: Any, who: str) -> float | None:
    """Model FLOPs per token at the length of the fit's first batch; None (with one info line naming
    what is missing) when the batch has no token ids or the module no `flops_per_token` hook."""
    seq_len = sequence_length(trainer.first_train_batch)
    if seq_len is None:
        rank_zero_info(
            f"{who}: no model FLOP/s, the batches carry no input_ids to read the sequence length from"
        )
        return None
    flops = model_flops_per_token(module, seq_len)
    if flops is None:
        rank_zero_info(
            f"{who}: no model FLOP/s, {type(module).__name__} declares no flops_per_token(seq_len) "
            "(or pass flops_per_token=...)"
        )
    return flops


def no_peak_reason(device: torch.device) -> str:
    """Why a device has no peak FLOP/s, for the info line."""
    if device.type != "cuda":
        return f"the run is on {device.type}, and MFU needs a GPU's peak FLOP/s"
    name = torch.cuda.get_device_name(device)
    return f"{name!r} is not in the peak FLOP/s table (callbacks.mfu.PEAK_BF16_FLOPS)"
