"""Which share of the training data a rank of a replica group reads: the replica groups split the data
first, then the group's own data-parallel ranks split the group's share."""

from __future__ import annotations

from collections.abc import Iterable

from strategies.base import Strategy
from strategies.parallel import ParallelStrategy
from trainer.data.distributed import shard_loader
from trainer.fault_tolerance.config import FaultTolerance


def check_strategy(strategy: Strategy, setting: str = "fault_tolerance=") -> None:
    """A one-line error (before any process starts) for a strategy that samples its own data (DP-SGD's
    Poisson sampling): its batches cannot be split over replica groups, nor left to the user (`setting`)."""
    # the parallel strategy's override only refuses evaluation under some pipeline schedules
    if type(strategy).process_dataloader not in (
        Strategy.process_dataloader,
        ParallelStrategy.process_dataloader,
    ):
        raise ValueError(
            f"{setting} with {type(strategy).__name__}, which samples its own batches; allowed: a "
            "strategy that reads the user's loader split over its ranks (single, ddp, fsdp, 3d)"
        )


def replica_loader(loader: Iterable, config: FaultTolerance, strategy: Strategy, seed: int) -> Iterable:
    """This rank's train loader: shard `replica_id * dp_size + dp_rank` of `replicas * dp_size`. A group
    that is down leaves its shard unread for those steps (see the package's note on shrunken steps)."""
    rank = config.replica_id * strategy.dp_size + strategy.dp_rank
    return shard_loader(loader, rank, config.replicas * strategy.dp_size, seed)
