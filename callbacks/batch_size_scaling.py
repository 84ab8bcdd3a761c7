"""The batch size search (Lightning's `tuner/batch_size_scaling.py`): trials of a few optimizer steps at growing
batch sizes until one runs out of memory; "power" doubles until then and keeps the last size that ran,
"binsearch" then bisects between it and the one that failed and takes `margin` off. Each trial's changes to
the training state are put back (`Trainer.run_trial`); the size found stays in the module's (hparams',
datamodule's) `batch_arg_name`, and the fit's loaders are read again with it."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

from callbacks.tuning import get_attribute, set_attribute
from trainer.core.logging import log, rank_zero_info

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class BatchSizeSearch:
    """One search over a fit: the module whose `name` attribute sets the loaders' batch size, `steps` optimizer
    steps per trial, at most `max_trials` trials and sizes below `max_val`."""

    def __init__(
        self, trainer: Trainer, module: TrainModule, name: str, steps: int, max_trials: int, max_val: int
    ) -> None:
        self.trainer, self.module, self.name = trainer, module, name
        self.steps, self.max_trials, self.max_val = steps, max_trials, max_val

    def run(self, mode: str, init_val: int, margin: float) -> int:
        """The batch size found; the fit's loaders read with it."""
        size, _ = self.adjust(value=init_val)
        # Lightning's first trial reads the loader it had before `init_val` was set; this one reads init_val's (a
        # train loader passed to fit() cannot be read again: the one-line error comes here, before any trial)
        self.trainer.reload_dataloaders()
        try:
            size = self.power(size) if mode == "power" else self.binsearch(size, margin)
            _collect_garbage()
            log.info(f"Finished batch size finder, will continue with full run using batch size {size}")
        finally:
            self.trainer.reload_dataloaders()
        return size

    def power(self, size: int) -> int:
        """Double after each trial that ran; after one that ran out of memory, halve and stop (unless none
        ran yet: then go on halving)."""
        any_success = False
        for i in range(self.max_trials):
            _collect_garbage()
            if size >= self.max_val:
                rank_zero_info(f"Reached the maximum batch size limit of {self.max_val}. Stopping search.")
                break
            if self.trial():
                if i + 1 >= self.max_trials:
                    break
                size, changed = self.adjust(factor=2.0, desc="succeeded")
                if not changed:
                    break
                self.trainer.reload_dataloaders()
                any_success = True
            else:
                size, _ = self.adjust(factor=0.5, desc="failed")
                self.trainer.reload_dataloaders()
                if any_success:
                    break
        return size

    def binsearch(self, size: int, margin: float) -> int:
        """Double until a trial runs out of memory, then bisect between the last size that ran and the first
        that did not; `margin` of the result taken off (at least 1)."""
        low, high, count = 1, None, 0
        while True:
            _collect_garbage()
            if size >= self.max_val:
                rank_zero_info(f"Reached the maximum batch size limit of {self.max_val}. Stopping search.")
                break
            if self.trial():
                count += 1
                if count >= self.max_trials:
                    break
                low = size
                if high is not None and high - low <= 1:
                    break
                if high is not None:
                    size, changed = self.adjust(value=(high + low) // 2, desc="succeeded")
                else:
                    size, changed = self.adjust(factor=2.0, desc="succeeded")
                if not changed:
                    break
                self.trainer.reload_dataloaders()
            else:
                high = size
                size, _ = self.adjust(value=(high + low) // 2, desc="failed")
                self.trainer.reload_dataloaders()
                if high - low <= 1:
                    break
        reduced = max(1, int(size * (1 - margin)))
        if margin > 0 and reduced != size:
            rank_zero_info(f"Applying margin of {margin:.1%}, reducing batch size from {size} to {reduced}")
            size = reduced
            set_attribute(self.module, self.trainer.datamodule, self.name, size)
        return size

    def trial(self) -> bool:
        """Whether `steps` optimizer steps at the current batch size ran without running out of memory."""
        try:
            self.trainer.run_trial(self.steps)
        except RuntimeError as err:
            if not is_out_of_memory(err):
                raise
            _collect_garbage()
            return False
        return True

    def adjust(
        self, factor: float = 1.0, value: int | None = None, desc: str | None = None
    ) -> tuple[int, bool]:
        """Set the batch size to `value` (else the current one x `factor`, capped at `max_val`); the new size
        and whether it changed. At or above the dataset's length the size stays, as in Lightning."""
        datamodule = self.trainer.datamodule
        size = get_attribute(self.module, datamodule, self.name)
        length = _dataset_length(self.trainer.train_dataloader)
        if length is not None and size >= length:
            rank_zero_info(
                f"The batch size {size} is greater or equal than the length of your dataset: {length}."
            )
            return size, False
        new = value if value is not None else int(size * factor)
        if new > self.max_val:
            if desc:
                rank_zero_info(
                    f"Batch size {new} exceeds max_val limit {self.max_val}, capping at {self.max_val}"
                )
            new = self.max_val
        if desc:
            rank_zero_info(f"Batch size {size} {desc}, trying batch size {new}")
        set_attribute(self.module, datamodule, self.name, new)
        return new, new != size


def is_out_of_memory(err: BaseException) -> bool:
    """torch's OutOfMemoryError, or the messages Lightning reads as one (CUDA, cuDNN, the CPU allocator)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = err.args[0] if isinstance(err, RuntimeError) and len(err.args) == 1 else ""
    return isinstance(text, str) and (
        ("CUDA" in text and "out of memory" in text)
        or "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED." in text
        or "DefaultCPUAllocator: can't allocate memory" in text
    )


def _dataset_length(loader: object) -> int | None:
    dataset = getattr(loader, "dataset", None)
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def _collect_garbage() -> None:
    """Give the GPU memory a trial left back before the next one (Lightning's garbage_collection_cuda). Without
    CUDA there is none to give back: Lightning's gc.collect costs a few tenths of a second per trial there."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
