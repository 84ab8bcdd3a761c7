"""A step's quorum formed while the step reads its data and runs its forward: torchft's synchronous quorum
(`Manager.start_quorum` with use_async_quorum=False) split in time, its request at the step's start and its
wait (with a recovery's load) where the step first needs it, before the first backward. The semantics stay
the synchronous ones (every group of the quorum takes part, a recovering group included); a group that
recovers throws the step's work so far away and runs the step again from the peer's position and state,
so the run is the one the synchronous quorum gives, bit for bit. torchft's async quorum instead heals
inside the step, with the healing group's gradients zeroed. Both halves, and the commit vote, leave out the
Python work torchft does on top of its calls every step (profiler ranges, log records, a quorum's handling
when it is the previous one again): ~0.3 ms of CPU per step on the step's path and the quorum thread."""

from __future__ import annotations

from typing import Any

import torch


class Healed(Exception):
    """This group took a peer's training state at the step's quorum: what the step computed before is
    void; the loop reads the step's data again from the peer's position and runs it on the peer's state."""


def request_quorum(manager: Any) -> None:
    """The first half of torchft 0.2.0's `Manager.start_quorum`: the quorum (and a recovery) submitted to the
    manager's quorum thread, without waiting for it. torchft has no public call for the split: the private
    names it reads and sets are the ones `start_quorum` does, with its defaults (the whole quorum heals)."""
    if manager._quorum_future is not None:  # the previous step's, already joined
        manager._quorum_future.result()
    reset_for_step(manager)
    device = torch.accelerator.current_device_index() if torch.accelerator.is_available() else -1
    manager._quorum_future = manager._executor.submit(_quorum, manager, device)


def reset_for_step(manager: Any) -> None:
    """What torchft's manager resets as a step starts (the previous step's recorded error, such as a
    callback's skip): in `request_quorum`, and alone in a step that keeps the last quorum (quorum_every)."""
    manager._errored = None
    manager._healing = False


def _quorum(manager: Any, device: int) -> None:
    """On the quorum thread: torchft's `Manager._async_quorum`, whose handling of the lighthouse's answer (the
    process group reconfigured, a recovery sent or received) is skipped when there is nothing to handle: the
    quorum is the one the process group has (same id), this group does not heal and no peer heals from it.
    The participants are then set as torchft sets them (synchronous quorum, every group of it takes part)."""
    client = manager._client
    quorum = client._quorum(
        group_rank=manager._group_rank,
        step=manager._step,
        checkpoint_metadata=manager._checkpoint_transport.metadata(),
        shrink_only=False,
        timeout=manager._quorum_timeout,
        init_sync=manager._init_sync,
        commit_failures=manager._commit_failures,
    )
    if quorum.quorum_id == manager._quorum_id and not quorum.heal and not quorum.recover_dst_replica_ranks:
        manager._participating_replica_rank = quorum.replica_rank
        manager._participating_replica_world_size = quorum.replica_world_size
        return
    # torchft's own handling of this answer: its call for the quorum gets the one already received (the main
    # thread makes no call on the client while the quorum forms: it joins before the commit vote)
    manager._client = _Answered(client, quorum)
    try:
        manager._async_quorum(
            allow_heal=True, shrink_only=False, quorum_timeout=manager._quorum_timeout, curr_device=device
        )
    finally:
        manager._client = client


class _Answered:
    """A manager client whose quorum call returns `quorum` (already received); every other call goes to
    `client`."""

    def __init__(self, client: Any, quorum: Any) -> None:
        self.client, self.quorum = client, quorum

    def _quorum(self, **kwargs: Any) -> Any:
        return self.quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def join_quorum(manager: Any) -> bool:
    """The second half of `start_quorum`: wait for the quorum; a group that was behind loads the peer's state
    it received (the registered load function runs here, on the calling thread). True when it did; False
    too when its recovery failed (torchft recorded the error: the step is discarded, the state unchanged)."""
    manager.wait_quorum()  # raises the quorum's error (no quorum within the timeout)
    if not manager._healing:
        return False
    received = manager._pending_state_dict is not None
    manager._apply_pending_state_dict()
    manager._healing = False  # healed before the step's first collective: a full participant
    return received


def participants(manager: Any) -> int:
    """The groups taking part in the joined quorum (torchft's `num_participants`, without its wait)."""
    return manager._participating_replica_world_size


def commit_vote(manager: Any) -> bool:
    """torchft 0.2.0's `Manager.should_commit` once the quorum was joined (`join_quorum` applied a recovery):
    whether the group applies the step, voted over its ranks, the manager's step counted; without its
    profiler ranges and log records."""
    committed = manager._client.should_commit(
        manager._group_rank, manager._step, own_vote(manager), timeout=manager._timeout
    )
    manager._checkpoint_transport.disallow_checkpoint()
    participants = manager._participating_replica_world_size
    if committed:
        manager._step += 1
        manager._batches_committed += participants
        manager._commit_failures = 0
    else:
        manager._commit_failures += 1
    return committed


def own_vote(manager: Any) -> bool:
    """This rank's vote on the step (torchft's `should_commit` before it asks the group): enough groups took
    part and nothing failed here, a recovery's copy and the device's work finished first."""
    if manager._recovery_event is not None:  # a recovery ran on its own stream
        manager._recovery_event.synchronize()
        manager._recovery_event = None
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
    error = manager._pg.errored()
    if error is not None:
        manager.report_error(error)
    return manager._participating_replica_world_size >= manager._min_replica_size and manager._errored is None
