"""A step's quorum formed while the step reads its data and runs its forward: torchft's synchronous quorum
(`Manager.start_quorum` with use_async_quorum=False) split in time, its request at the step's start and its
wait (with a recovery's load) where the step first needs it, before the first backward. The semantics stay
the synchronous ones (every group of the quorum takes part, a recovering group included); a group that
recovers throws the step's work so far away and runs the step again from the peer's position and state,
so the run is the one the synchronous quorum gives, bit for bit. torchft's async quorum instead heals
inside the step, with the healing group's gradients zeroed."""

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
    manager._errored = None
    manager._healing = False
    manager._quorum_future = manager._executor.submit(
        manager._async_quorum,
        allow_heal=True,
        shrink_only=False,
        quorum_timeout=manager._quorum_timeout,
        curr_device=torch.accelerator.current_device_index() if torch.accelerator.is_available() else -1,
    )


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
