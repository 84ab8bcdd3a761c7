"""torchft's `Manager` as a replica group starts it: its own store and manager server bound to the group's
address, the process group across the groups (NCCL on GPUs, else gloo), the state sent over it."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainer.fault_tolerance.config import HEARTBEAT_INTERVAL_MS, FaultTolerance, tokio_workers

if TYPE_CHECKING:
    from strategies.base import Strategy


def require_torchft() -> Any:
    """The torchft module, or a one-line error saying how to install it (checked before any process starts)."""
    try:
        return importlib.import_module("torchft")
    except ImportError as err:
        raise ImportError(
            f"Trainer(fault_tolerance=...) needs torchft, which is not installed ({err}); "
            "install the extra: pip install 'trainer[ft]'"
        ) from None


def start_manager(strategy: Strategy, config: FaultTolerance) -> tuple[Any, Any, Any]:
    """This rank's torchft `Manager`, the process group across the groups it reconfigures, and the group's
    store (rank 0's, else None: it serves while referenced)."""
    require_torchft()
    from torchft import Manager
    from torchft.checkpointing.pg_transport import PGTransport

    timeout = timedelta(seconds=config.timeout_s)
    # the group's own store, bound to `bind` (not the launcher's: a restarted group would read the
    # manager address its previous incarnation left there)
    store = (
        dist.TCPStore(config.bind, 0, is_master=True, wait_for_workers=False)
        if strategy.global_rank == 0
        else None
    )
    # rank 0's address: with a group spread over nodes the other ranks' own `bind` is not where it listens
    host, port = strategy.broadcast_object((config.bind, store.port) if store is not None else None)
    pg = _process_group(strategy.root_device, timeout)
    with _manager_server_bound_to(config.bind), tokio_workers():
        manager = Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=config.min_replicas,
            # synchronous semantics (a recovering group is a full participant of the step, which it
            # runs again from the peer's data position), the wait split from the request (quorum.py)
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=timeout,
            rank=strategy.global_rank,
            world_size=strategy.world_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=config.lighthouse_url,
            replica_id=config.replica_name,
            hostname=config.bind,
            # the lighthouse's heartbeat timeout is HEARTBEAT_TIMEOUT_MS unless it was started with another
            heartbeat_interval=timedelta(milliseconds=HEARTBEAT_INTERVAL_MS),
            # the state goes rank to rank over the groups' own process group: no extra server
            checkpoint_transport=PGTransport(pg, timeout, strategy.root_device),
        )
    return manager, pg, store


def _process_group(device: torch.device, timeout: timedelta) -> Any:
    """torchft's reconfigurable process group across the replica groups: NCCL on GPUs, else gloo."""
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    return ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)


@contextlib.contextmanager
def _manager_server_bound_to(host: str) -> Iterator[None]:
    """torchft 0.2.0's Manager starts its server on `[::]:port` (every interface) with no option to choose;
    for the time of its construction, the server it starts listens on `host` instead."""
    import torchft.manager as torchft_manager

    original = torchft_manager.ManagerServer
    listen = f"[{host}]" if ":" in host else host

    def bound(*args: Any, bind: str, **kwargs: Any) -> Any:
        return original(*args, bind=f"{listen}:{bind.rpartition(':')[2]}", **kwargs)

    torchft_manager.ManagerServer = bound
    try:
        yield
    finally:
        torchft_manager.ManagerServer = original
