"""MeshStrategy: what every multi-process strategy shares. It joins or starts the job (trainer.launch),
creates the process group (gloo on the CPU, NCCL on GPUs) and the DeviceMesh of the strategy's parallel
dimensions, and implements the collectives the Trainer uses.

The process group's store is namespaced per restart attempt: after a torchrun restart, keys left by
the failed attempt would otherwise send gloo to dead peers ('Connection refused' in connectFullMesh).
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from strategies.base import Strategy
from trainer.launch import World, destroy_process_group, detect_world, exit_quietly_when_done, spawn_and_run
from trainer.logging import set_rank
from trainer.precision import Precision

DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")
_TIMEOUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)


class MeshStrategy(Strategy):
    """A strategy over several processes; subclasses name their mesh in `mesh_dims()`.

    `timeout_s` bounds every collective: a rank that waits longer raises an error naming the ranks
    that never arrived, instead of hanging for torch's default 30 minutes.
    """

    def __init__(self, timeout_s: float = 600.0) -> None:
        super().__init__()
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid; allowed: a number of seconds > 0")
        self.timeout_s = float(timeout_s)
        self.world: World | None = None
        self.mesh: DeviceMesh | None = None
        self._store: dist.Store | None = None

    def mesh_dims(self) -> dict[str, int]:
        """Parallel dimension name -> size; the product is the world size."""
        return {"dp_replicate": self.world_size}

    # ---- set-up ----------------------------------------------------------------------------------
    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: Precision) -> None:
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
        super().configure(accelerator, devices, num_nodes, precision)

    def launch(self, function: Callable[..., Any], *args: Any) -> Any:
        """Join the running job, or start `devices` processes of this program and run in each."""
        if detect_world() is None:
            return spawn_and_run(self.devices, self._run_and_report, function, *args)
        return self._run_and_report(function, *args)

    def setup_environment(self) -> None:
        world = self.world = detect_world()
        if self.accelerator == "cuda":
            torch.cuda.set_device(world.local_rank)
            self._device = torch.device("cuda", world.local_rank)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if not dist.is_initialized():
            store = dist.TCPStore(
                world.master_addr,
                world.master_port,
                world.world_size,
                is_master=world.rank == 0 and not world.agent_store,
                timeout=timeout,
            )
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
        dims = self.mesh_dims()
        if math.prod(dims.values()) != world.world_size:
            shape = " x ".join(f"{k}={v}" for k, v in dims.items())
            raise ValueError(
                f"mesh {shape} has {math.prod(dims.values())} ranks but the world has {world.world_size}"
            )
        self.mesh = init_device_mesh(self.root_device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))

    # ---- who is who ------------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else self.devices * self.num_nodes

    @property
    def dp_rank(self) -> int:
        rank, names = 0, self.mesh.mesh_dim_names
        for name in (n for n in names if n in DATA_PARALLEL_DIMS):
            rank = rank * self.mesh.size(names.index(name)) + self.mesh.get_local_rank(name)
        return rank

    @property
    def dp_size(self) -> int:
        names = self.mesh.mesh_dim_names
        return math.prod(self.mesh.size(names.index(n)) for n in names if n in DATA_PARALLEL_DIMS)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The process group of the data-parallel ranks (a 1-D data-parallel mesh)."""
        dims = [n for n in self.mesh.mesh_dim_names if n in DATA_PARALLEL_DIMS]
        if len(dims) != 1:
            raise RuntimeError(
                f"the data-parallel ranks span mesh dims {dims}; a single process group needs one"
            )
        return self.mesh.get_group(dims[0])

    # ---- collectives -----------------------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        ops = {
            "mean": dist.ReduceOp.SUM,
            "sum": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
        }
        if op not in ops:
            raise ValueError(f"reduce op {op!r} is unknown; allowed: {', '.join(ops)}")
        out = tensor.detach().clone().to(self.root_device)
        dist.all_reduce(out, op=ops[op])
        return out / dist.get_world_size() if op == "mean" else out

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    # ---- failures --------------------------------------------------------------------------------
    def _run_and_report(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run the work; a collective timeout becomes an error naming the ranks that never arrived, and
        under torchrun the error is recorded so the agent's summary shows it."""
        try:
            return function(*args)
        except Exception as err:
            if self._store is None or not _TIMEOUT.search(str(err)):
                _record_for_torchelastic(err)
                raise
            report = RuntimeError(self._timeout_report(err))
            _record_for_torchelastic(report)
            raise report from err

    def _timeout_report(self, err: Exception) -> str:
        """Every rank that timed out says so in the store; the ranks that never do are the ones stuck."""
        world = self.world
        self._store.set(f"timed-out/{world.rank}", "1")
        time.sleep(min(5.0, self.timeout_s / 2))  # let the other waiting ranks report too
        try:
            silent = [r for r in range(world.world_size) if not self._store.check([f"timed-out/{r}"])]
        except Exception:  # the store lives in rank 0 (or the agent): it is gone
            silent = []
        who = f"rank(s) {silent} stopped answering" if silent else "the other ranks could not be reached"
        return (
            f"rank {world.rank}: a collective timed out after {self.timeout_s:g}s; {who} (hung, crashed, or "
            f"slower than timeout_s). Original error: {str(err).splitlines()[0]}"
        )

    def teardown(self) -> None:
        """The process group stays up for the next fit/validate of this process; the OS frees it at exit."""


def _record_for_torchelastic(err: BaseException) -> None:
    """Under torchrun, write the error file its agent reads, so its failure summary shows this error."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)
