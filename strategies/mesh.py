"""MeshStrategy: what every multi-process strategy shares. It joins or starts the job (trainer.core.launch),
creates the process group (gloo on the CPU, NCCL on GPUs) and the named groups of the strategy's
ParallelDims (strategies/parallel_dims.py), and implements the collectives, each over a named group.

The process group's store is namespaced per restart attempt: after a torchrun restart, keys left by
the failed attempt would otherwise send gloo to dead peers ('Connection refused' in connectFullMesh).
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import re
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from strategies import collectives
from strategies.base import Strategy
from strategies.checkpoint_io import CheckpointIO
from strategies.checkpoint_io.sharded_state import ShardedState
from strategies.parallel_dims import ParallelDims, ParallelMesh
from trainer import flags
from trainer.core.launch import (
    World,
    destroy_process_group,
    detect_world,
    exit_quietly_when_done,
    report_arrival,
    spawn_and_run,
    take_spawned_store,
)
from trainer.core.logging import rank_zero_info, set_rank

IO_FLOOR_BYTES_PER_S = 20e6  # a disk slower than 20 MB/s per rank is broken, not slow
_TIMEOUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)


class MeshStrategy(Strategy):
    """A strategy over several processes; subclasses give their parallel degrees in `parallel_dims()`.

    `timeout_s` bounds every collective: a rank that waits longer raises an error naming the ranks
    that never arrived, instead of hanging for torch's default 30 minutes. Waits on checkpoint I/O get
    `timeout_s` plus the slowest rank's bytes at IO_FLOOR_BYTES_PER_S (`begin_io`), so a large save is
    never taken for a hang.
    """

    def __init__(self, timeout_s: float = 600.0) -> None:
        super().__init__()
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid; allowed: a number of seconds > 0")
        self.timeout_s = float(timeout_s)
        self._io: tuple[Any, float] | None = None  # (the gloo group of checkpoint I/O waits, its timeout)
        self.async_save = False  # strategies that offer it set it from their argument
        self.checkpoint_io: CheckpointIO = ShardedState(self)  # each rank writes its own part
        self.world: World | None = None
        self.mesh: ParallelMesh | None = None  # the named groups, built in setup_environment
        self._store: dist.Store | None = None

    def parallel_dims(self) -> ParallelDims:
        """This strategy's parallel degrees (plain data parallel: every rank a replica)."""
        return ParallelDims(dp_replicate=self.world_size, dp_shard=1)

    # ---- set-up ----------------------------------------------------------------------------------
    def check_configuration(self) -> None:
        accelerator, devices, num_nodes = self.accelerator, self.devices, self.num_nodes
        if accelerator == "cuda" and devices > torch.cuda.device_count():
            raise ValueError(
                f"devices={devices} but this machine has {torch.cuda.device_count()} CUDA devices; "
                f"allowed: 1..{torch.cuda.device_count()}"
            )
        world = detect_world()
        if world is not None and (
            world.local_world_size != devices or world.world_size != devices * num_nodes
        ):
            raise ValueError(
                f"the {world.source} job has {world.local_world_size} processes per node and {world.world_size} in all, "
                f"but the Trainer has devices={devices}, num_nodes={num_nodes}; allowed: devices={world.local_world_size}, "
                f"num_nodes={world.world_size // max(world.local_world_size, 1)} (or devices='auto')"
            )
        if world is None and num_nodes > 1:
            raise ValueError(
                f"num_nodes={num_nodes} needs a launcher that starts every node; allowed: run under "
                "torchrun --nnodes=N (or srun on SLURM), or num_nodes=1"
            )
        super().check_configuration()
        self.parallel_dims().resolve(devices * num_nodes)  # a mesh that does not fit fails before spawning

    def launch(self, function: Callable[..., Any], *args: Any) -> Any:
        """Join the running job, or start `devices` processes of this program and run in each."""
        if detect_world() is None:
            return spawn_and_run(self.devices, self._run_and_report, function, *args)
        return self._run_and_report(function, *args)

    def setup_environment(self) -> None:
        world = self.world = detect_world()
        if self.accelerator == "cuda":
            self._device = flags.device_for(self.accelerator, self.device_ids, world.local_rank)
            torch.cuda.set_device(self._device)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if not dist.is_initialized():
            store = take_spawned_store()  # a self-spawned rank 0 bound its store before starting the others
            if store is None:
                store = dist.TCPStore(
                    world.master_addr,
                    world.master_port,
                    world.world_size,
                    is_master=world.rank == 0 and not world.agent_store,
                    timeout=timeout,
                )
            store.set_timeout(timeout)
            self._store = dist.PrefixStore(f"trainer/attempt-{world.restart_count}", store)
            backend = "nccl" if self.accelerator == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("pg", self._store),
                rank=world.rank,
                world_size=world.world_size,
                timeout=timeout,
            )
            spawned_by_us = world.source == "spawned"
            if spawned_by_us and world.rank > 0:
                exit_quietly_when_done()
            if not (spawned_by_us and world.rank == 0):  # a self-spawning rank 0 does it after its children
                atexit.register(destroy_process_group)
        set_rank(world.rank)
        if self.mesh is None:  # the groups outlive a fit: this process's next fit/validate reuses them
            self.mesh = self.parallel_dims().build(self.root_device.type, timeout)
            rank_zero_info(self.mesh.describe())

    # ---- who is who ------------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))

    @property
    def local_rank(self) -> int:
        return self.world.local_rank if self.world is not None else int(os.environ.get("LOCAL_RANK", 0))

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else self.devices * self.num_nodes

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The process group of the batch view: the ranks that read different data (DDP's replicas)."""
        return self.mesh.group("batch")

    def planned_group_size(self, name: str) -> int:
        return self.parallel_dims().resolve(self.devices * self.num_nodes).size(name)

    def group_rank(self, name: str) -> int:
        return self.mesh.rank(name)

    def group_size(self, name: str) -> int:
        return self.mesh.size(name)

    # ---- collectives (strategies/collectives.py) --------------------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "mean", *, group: str) -> torch.Tensor:
        return collectives.reduce(self.mesh, tensor, op, group, self.root_device)

    def all_gather_object(self, obj: Any, *, group: str = "world") -> list[Any]:
        return collectives.all_gather_object(self.mesh, obj, group)

    def broadcast_object(self, obj: Any, src: int = 0, *, group: str = "world") -> Any:
        return collectives.broadcast_object(self.mesh, obj, src, group)

    def barrier(self, *, group: str = "world") -> None:
        collectives.barrier(self.mesh, group)

    # ---- waits on checkpoint I/O ------------------------------------------------------------------
    def begin_io(self, nbytes: int) -> None:
        """Size the waits on this checkpoint's I/O to its slowest rank: `timeout_s` plus that rank's bytes
        at IO_FLOOR_BYTES_PER_S, over a gloo group of their own (re-created only when a larger state needs
        longer). So a large save is never cut off by the fixed timeout meant for a hung collective."""
        most = int(self.reduce(torch.tensor(float(nbytes), device=self.root_device), "max", group="world"))
        seconds = self.timeout_s + most / IO_FLOOR_BYTES_PER_S
        if self._io is None or self._io[1] < seconds:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
            self._io = (group, seconds)

    def io_barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.io_group)

    def io_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.io_group)
        return gathered

    @property
    def io_group(self) -> Any:
        if self._io is None:
            self.begin_io(0)
        return self._io[0]

    # ---- failures --------------------------------------------------------------------------------
    def _run_and_report(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run the work; a collective timeout becomes an error naming the ranks that never arrived, and
        under torchrun the error is recorded so the agent's summary shows it."""
        report_arrival()  # a rank that rank 0 started: rank 0 joins the process group once all have come
        try:
            return function(*args)
        except Exception as err:
            # torch's own collective errors only: an error of ours that names a timeout setting (fault
            # tolerance's no-quorum line says quorum_timeout_s) already says what happened
            torchs = isinstance(err, dist.DistError) or type(err) is RuntimeError
            if self._store is None or not torchs or not _TIMEOUT.search(str(err)):
                _record_for_torchelastic(err)
                raise
            report = RuntimeError(self._timeout_report(err))
            _record_for_torchelastic(report)
            raise report from err

    def _timeout_report(self, err: Exception) -> str:
        """Every rank that timed out says so in the store; the ranks that never do are the ones stuck."""
        world = self.world
        self._store.set(f"timed-out/{world.rank}", "1")
        try:
            silent = self._silent_ranks(deadline=time.monotonic() + min(5.0, self.timeout_s / 2))
        except Exception:  # the store lives in rank 0 (or the agent): it is gone
            silent = []
        who = f"rank(s) {silent} stopped answering" if silent else "the other ranks could not be reached"
        return (
            f"rank {world.rank}: a collective timed out after {self.timeout_s:g}s; {who} (hung, crashed, or "
            f"slower than timeout_s). Original error: {str(err).splitlines()[0]}"
        )

    def _silent_ranks(self, deadline: float) -> list[int]:
        """The ranks that have not said they timed out, once all have or at `deadline`: the other waiting
        ranks time out moments after this one, a stuck rank never does."""
        keys = [f"timed-out/{r}" for r in range(self.world.world_size)]
        while not self._store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)  # a poll: the store's own wait would log a warning each time it expires
        return [r for r, key in enumerate(keys) if not self._store.check([key])]

    def teardown(self) -> None:
        """The process group stays up for the next fit/validate of this process; the OS frees it at exit."""


def _record_for_torchelastic(err: BaseException) -> None:
    """Under torchrun, write the error file its agent reads, so its failure summary shows this error.

    Written whole or not at all (a temporary file renamed over it): the agent SIGTERMs the other ranks as
    soon as one fails, and a rank stopped between opening the file and writing it left an empty file that
    crashed the agent's summary (JSONDecodeError) instead of restarting the job."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {  # the layout torch.distributed.elastic's ErrorHandler.record_exception writes
            "message": f"{type(err).__name__}: {err}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(err)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as file:
        json.dump(data, file)
    os.replace(partial, path)
