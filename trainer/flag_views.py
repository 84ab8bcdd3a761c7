"""The Trainer's checked flags as read-only properties under Lightning's names (`trainer.max_steps`,
`trainer.limit_val_batches`, ...), each read from the one `LoopFlags` object the Trainer keeps as `flags`."""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

from trainer.flags import LoopFlags, check_int


class FlagViews:
    """The loop flags, one property each; `flags` holds them all, checked, as one typed object."""

    flags: LoopFlags

    @property
    def max_steps(self) -> int | None:
        """Optimizer steps after which the fit stops (None: no such limit)."""
        return self.flags.max_steps

    @property
    def max_epochs(self) -> int | None:
        """Epochs after which the fit stops (None: no such limit; neither given: 1)."""
        return self.flags.max_epochs

    @property
    def min_steps(self) -> int | None:
        """Optimizer steps before which `should_stop` does not end the fit (None: no such minimum)."""
        return self.flags.min_steps

    @property
    def min_epochs(self) -> int | None:
        """Epochs before which `should_stop` does not end the fit (None: no such minimum)."""
        return self.flags.min_epochs

    @property
    def val_check_interval(self) -> int | float | datetime.timedelta | None:
        """Validate every this many optimizer steps (int), fraction of an epoch (float) or time since the last
        validation (timedelta); None: at epoch ends."""
        return self.flags.val_check_interval

    @property
    def val_at_start(self) -> bool:
        """Also validate before the first step of a fresh run (the baseline)."""
        return self.flags.val_at_start

    @property
    def num_sanity_val_steps(self) -> int:
        """Validation batches run before training, nothing logged (-1: all)."""
        return self.flags.num_sanity_val_steps

    @property
    def enable_model_summary(self) -> bool:
        """Whether the fit starts with the model's summary line."""
        return self.flags.enable_model_summary

    @property
    def check_val_every_n_epoch(self) -> int | None:
        """Validate at the end of every n-th epoch (None: every `val_check_interval` steps only)."""
        return self.flags.check_val_every_n_epoch

    @property
    def max_time(self) -> float | None:
        """Seconds of training after which the fit stops, with a checkpoint (None: no limit)."""
        return self.flags.max_time

    @property
    def limit_train_batches(self) -> int | float | None:
        """Train batches per epoch: a count, a fraction of the loader, or None (all)."""
        return self.flags.limit_train_batches

    @property
    def limit_val_batches(self) -> int | float | None:
        """Validation batches per validation: a count, a fraction, or None (all)."""
        return self.flags.limit_val_batches

    @property
    def limit_test_batches(self) -> int | float | None:
        """Test batches: a count, a fraction, or None (all)."""
        return self.flags.limit_test_batches

    @property
    def limit_predict_batches(self) -> int | float | None:
        """Predict batches: a count, a fraction, or None (all)."""
        return self.flags.limit_predict_batches

    @property
    def accumulate_grad_batches(self) -> int:
        """Micro-batches per optimizer step."""
        return self.flags.accumulate_grad_batches

    @accumulate_grad_batches.setter
    def accumulate_grad_batches(self, value: int) -> None:
        """Writable as in Lightning (GradientAccumulationScheduler sets it at epoch starts; the fit reads it per
        step): checked as the constructor checks it, and the flags replaced whole, never changed in place."""
        checked = check_int("accumulate_grad_batches", value, 1)
        self.flags = dataclasses.replace(self.flags, accumulate_grad_batches=checked)

    @property
    def gradient_clip_val(self) -> float | None:
        """The clipping threshold (None: no clipping)."""
        return self.flags.gradient_clip_val

    @property
    def gradient_clip_algorithm(self) -> str:
        """ "norm" (the global L2 norm) or "value" (each element)."""
        return self.flags.gradient_clip_algorithm

    @property
    def lr_schedule(self) -> str:
        """The Trainer's own LR schedule's shape ("constant", "cosine", ...)."""
        return self.flags.lr_schedule

    @property
    def warmup_steps(self) -> int:
        """Linear LR warm-up steps of the Trainer's own schedule."""
        return self.flags.warmup_steps

    @property
    def min_lr_ratio(self) -> float:
        """The Trainer's own schedule's final LR as a fraction of the peak."""
        return self.flags.min_lr_ratio

    @property
    def deterministic(self) -> bool | str:
        """Whether deterministic algorithms are asked of torch during each stage ("warn": warn where none)."""
        return self.flags.deterministic

    @property
    def log_every_n_steps(self) -> int:
        """Optimizer steps between logged rows (the last step is always logged)."""
        return self.flags.log_every_n_steps

    @property
    def default_root_dir(self) -> Path:
        """Where logs and checkpoints go when their callbacks name no folder."""
        return self.flags.default_root_dir

    @property
    def enable_progress_bar(self) -> bool:
        """Whether rank zero shows the progress bar."""
        return self.flags.enable_progress_bar

    @property
    def enable_checkpointing(self) -> bool:
        """Whether a ModelCheckpoint is added when the callbacks have none."""
        return self.flags.enable_checkpointing

    @property
    def allow_unverified_checkpoints(self) -> bool:
        """Whether a checkpoint without a manifest loads (with a warning)."""
        return self.flags.allow_unverified_checkpoints

    @property
    def overfit_batches(self) -> int | float:
        """Train and validate on this many first batches (or this fraction), unshuffled; 0.0: off."""
        return self.flags.overfit_batches

    @property
    def benchmark(self) -> bool | None:
        """`torch.backends.cudnn.benchmark` during each stage (None: left as it is)."""
        return self.flags.benchmark

    @property
    def inference_mode(self) -> bool:
        """Whether validate/test/predict run under `torch.inference_mode` (else `torch.no_grad`)."""
        return self.flags.inference_mode

    @property
    def use_distributed_sampler(self) -> bool:
        """Whether each rank's loaders are its share of the data (False: read as given)."""
        return self.flags.use_distributed_sampler

    @property
    def detect_anomaly(self) -> bool:
        """Whether autograd's anomaly detection is on during each stage."""
        return self.flags.detect_anomaly

    @property
    def barebones(self) -> bool:
        """Lightning's speed-only mode (no checkpoints, loggers of yours, bar, summary or sanity check)."""
        return self.flags.barebones

    @property
    def sync_batchnorm(self) -> bool:
        """Whether BatchNorm layers normalise over the global batch under several data-parallel ranks."""
        return self.flags.sync_batchnorm

    @property
    def reload_dataloaders_every_n_epochs(self) -> int:
        """Call the datamodule's (or module's) loader methods again every n epochs (0: once per fit)."""
        return self.flags.reload_dataloaders_every_n_epochs

    @property
    def enable_autolog_hparams(self) -> bool:
        """Whether the hyperparameters go to the loggers when a fit starts."""
        return self.flags.enable_autolog_hparams

    @property
    def model_registry(self) -> str | None:
        """Lightning's model-hub name (kept for reading; this Trainer uploads nowhere)."""
        return self.flags.model_registry
