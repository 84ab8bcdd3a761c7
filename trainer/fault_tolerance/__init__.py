"""Per-step fault tolerance over replica groups, on torchft: lose a replica group, keep training.

The data-parallel replica dimension is managed by torchft. Each replica group (one process, or several
that shard the model inside it) is one member at the lighthouse. Every optimizer step:

1. quorum: the groups alive now agree on who takes part (asked for as the step starts, it forms while the
   step reads its data and runs its forward, and is waited for before the first backward: quorum.py); a
   group that is behind (it restarted) first receives a healthy peer's training state over the network
   (model, optimizer, LR schedule, loop counters, RNG, data position) and runs the step from there with
   bit-identical parameters;
2. the step's gradients are averaged over the participating groups from the backward, bucket by bucket
   (overlap.py; after the group's own DDP or FSDP reduction: overlap_ddp.py, overlap_fsdp.py);
3. commit or discard: the optimizer steps only when torchft agrees the step is good (enough groups, no
   collective failed). A discarded step changes neither parameters nor optimizer state; the data, the step
   counter and the LR schedule move on, as with `Trainer.skip_optimizer_step`.

A shrunken step (fewer groups than planned) averages over the groups present: its gradient is the mean over
a smaller global batch (participants x per-group batch), so the loss scale stays that of a mean and the LR
is unchanged; only the gradient's noise grows. The absent groups' data shards are not read in those steps:
their samples are skipped, not replayed (each group keeps its own shard, and a rejoining group takes the
current data position).

`FaultTolerance` (config.py) is the Trainer's flag; replica_group.py the per-step protocol on torchft's
Manager; state.py the state a rejoining group receives; lighthouse.py the coordinator (`trainer lighthouse`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.fault_tolerance.config import FaultTolerance

if TYPE_CHECKING:
    from strategies.base import Strategy

__all__ = ["FaultTolerance", "check_fault_tolerance"]


def check_fault_tolerance(config: FaultTolerance | None, strategy: Strategy) -> FaultTolerance | None:
    """The Trainer's `fault_tolerance` flag checked before any process starts: a `FaultTolerance`, torchft
    importable, a strategy whose data can be split over replica groups. None: no fault tolerance."""
    if config is None:
        return None
    if not isinstance(config, FaultTolerance):
        raise TypeError(
            f"fault_tolerance={type(config).__name__}; allowed: None or trainer.fault_tolerance.FaultTolerance(...)"
        )
    from trainer.fault_tolerance.data import check_strategy
    from trainer.fault_tolerance.manager import require_torchft

    require_torchft()
    check_strategy(strategy)
    return config
