"""TokenLoader: batches of packed samples, shuffled per epoch, sharded over data-parallel ranks, resumable."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from trainer.data.packing import PackedDataset


class TokenLoader:
    """Batches {"input_ids", "labels"} (LongTensor[B, T]) of a `PackedDataset` for one data-parallel rank.

    Each epoch every rank draws the same order of sample indices (a torch.Generator seeded with
    seed + epoch, or 0..N-1 without shuffle) and takes order[rank::world_size], so ranks see disjoint
    samples. Every rank must yield the same number of batches, else a collective waits forever:
    - drop_last=True: the order is cut to whole global batches (world_size * batch_size samples), so all
      batches are full and at most world_size * batch_size - 1 samples an epoch are skipped (with
      shuffle, a different few each epoch);
    - drop_last=False: the order is padded by repeating its head to a multiple of world_size, as torch's
      DistributedSampler does, so up to world_size - 1 samples are seen twice and the last batch may be short.

    `iter()` starts the current epoch at batch 0, except the first `iter()` after `load_state_dict`, which
    resumes at the saved position; exhausting the iterator advances the epoch. Use one iterator at a time.

    `pin_memory=True` builds each batch in pinned (page-locked) memory, from which a `non_blocking` copy
    to a GPU is asynchronous; the Trainer turns it on when its device is CUDA (`pin_for_device`).
    """

    def __init__(
        self,
        dataset: PackedDataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        rank: int = 0,
        world_size: int = 1,
        pin_memory: bool = False,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is invalid; allowed: an int >= 1")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError(
                "pin_memory=True needs CUDA, which this machine does not have; allowed: False (the Trainer "
                "pins the batches itself when it trains on a GPU)"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pin_memory = bool(pin_memory)
        self.epoch = 0
        self.position = 0  # batches already yielded in the current epoch
        self._resume_from: dict[str, int] | None = None
        self.shard_for_rank(rank, world_size)

    def shard_for_rank(self, rank: int, world_size: int) -> None:
        """Make this loader rank `rank`'s share of `world_size` data-parallel ranks (call before iterating)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is invalid; allowed: an int >= 1")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} is invalid; allowed: an int in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        if self.drop_last and len(self) == 0:
            raise ValueError(
                f"{len(self.dataset)} samples cannot fill one global batch of world_size * batch_size = "
                f"{world_size * self.batch_size}; allowed: at least that many samples (more text, a smaller "
                "seq_len or batch_size), or drop_last=False"
            )

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        samples, global_batch = len(self.dataset), self.world_size * self.batch_size
        if self.drop_last:
            return samples // global_batch
        per_rank = -(-samples // self.world_size)
        return -(-per_rank // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._resume_from is None:
            self.position = 0
        else:
            self._check_resumable(self._resume_from)
            self._resume_from = None
        return self._batches(self._rank_indices(), self.position)

    def _batches(self, indices: torch.Tensor, start: int) -> Iterator[dict[str, torch.Tensor]]:
        for position in range(start, len(self)):
            # Counted before the yield: a state_dict taken while the consumer holds this batch skips it.
            self.position = position + 1
            batch = self.dataset.batch(indices[position * self.batch_size : (position + 1) * self.batch_size])
            yield {key: value.pin_memory() for key, value in batch.items()} if self.pin_memory else batch
        self.epoch += 1
        self.position = 0

    def _rank_indices(self) -> torch.Tensor:
        """This rank's sample indices for the current epoch; O(samples), independent of the position."""
        samples, world = len(self.dataset), self.world_size
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(samples, generator=generator)
        else:
            order = torch.arange(samples)
        if self.drop_last:
            order = order[: samples - samples % (world * self.batch_size)]
        elif samples % world:
            pad = world - samples % world
            order = torch.cat([order, order.repeat(-(-pad // samples))[:pad]])
        return order[self.rank :: world]

    def set_epoch(self, epoch: int) -> None:
        """Make the next `iter()` start `epoch` at its first batch (the Trainer's epoch count is the truth,
        also when it stops an epoch early with limit_train_batches)."""
        self.epoch, self.position, self._resume_from = epoch, 0, None

    def state_dict(self) -> dict[str, int]:
        """Plain ints (readable by `torch.load(weights_only=True)`): where this epoch is, and the settings
        that give positions their meaning, checked when resuming."""
        return {"epoch": self.epoch, "position": self.position, **self._settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where `state` was taken: the next `iter()` continues with the batch that would have come next."""
        missing = sorted({"epoch", "position", *self._settings()} - set(state))
        if missing:
            raise ValueError(
                f"TokenLoader state lacks {missing}; allowed: a dict from TokenLoader.state_dict()"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        # Checked at iter(), not here: the framework may call shard_for_rank() after restoring.
        self._resume_from = {key: int(state[key]) for key in self._settings()}

    def _settings(self) -> dict[str, int]:
        """What a saved position means. Only the global batch (world_size x batch_size) counts, not its
        split: global batch k holds the same samples on any number of ranks, so a run may resume resharded."""
        return {
            "seed": self.seed,
            "num_samples": len(self.dataset),
            "global_batch": self.world_size * self.batch_size,
            "shuffle": int(self.shuffle),
            "drop_last": int(self.drop_last),
        }

    def _check_resumable(self, saved: dict[str, int]) -> None:
        for key, now in self._settings().items():
            if saved[key] != now:
                raise ValueError(
                    f"cannot resume TokenLoader: {key}={saved[key]} in the saved state but {now} now; "
                    "allowed: the same data and loader settings as the run that saved it"
                )


def pin_for_device(loader: Any, device: torch.device) -> None:
    """A TokenLoader feeding a CUDA device pins its batches, so the strategy's `non_blocking` copy of each
    is asynchronous: from pageable memory the host would wait, at every copy, for the GPU to finish the
    work queued before it (the step in flight). A user's own loader keeps the `pin_memory` it was given."""
    if isinstance(loader, TokenLoader) and device.type == "cuda":
        loader.pin_memory = True


def several_loaders(loader: Any) -> bool:
    """Whether `loader` is Lightning's list (or tuple) of evaluation loaders, run one after the other; a list
    of batches (tensors, tuples, dicts) is one loader."""
    return isinstance(loader, (list, tuple)) and all(
        hasattr(one, "__iter__") and not isinstance(one, (torch.Tensor, list, tuple, dict, str))
        for one in loader
    )
