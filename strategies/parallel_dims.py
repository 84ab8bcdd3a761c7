"""ParallelDims: the job's parallel degrees, validated against the world size before any process starts,
and built (once the process group exists) into one set of named process groups and DeviceMeshes.

The world is laid out row-major over (pp, dp_replicate, dp_shard, cp, tp): pp outermost, because stages
exchange little (activations at two boundaries) and may cross nodes; tp innermost, because it
communicates in every layer and must stay on one node. Every named view is a contiguous run of those
dims, so its groups are arithmetic progressions of ranks:

    batch  = dp_replicate x dp_shard       ranks that read different data
    loss   = dp_replicate x dp_shard x cp  where losses and token counts are reduced
    dense  = dp_shard x cp                 where dense (non-expert) parameters are sharded (FSDP)
    expert = dp_shard x cp x tp / ep       where expert parameters are sharded, in the layout
                                           (pp, dp_replicate, expert, ep) of the same world

`ep` adds no ranks: expert parallelism reuses the data, context and tensor ranks (innermost first),
so it must divide dp_shard x cp x tp. The shape follows TorchTitan's distributed/parallel_dims.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


class Group(str, enum.Enum):
    """The named process groups of the mesh. A view is named for what its ranks share: `batch` ranks read
    different data, `loss` ranks reduce losses and token counts, `dense` ranks shard non-expert parameters,
    `expert` ranks shard experts; the others are one dimension each. A string enum (StrEnum, written so for
    Python 3.10), so "tp" and Group.TP are the same name to every collective."""

    __str__ = str.__str__

    WORLD = "world"
    BATCH = "batch"
    LOSS = "loss"
    DENSE = "dense"
    EXPERT = "expert"
    EP = "ep"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    PP = "pp"


GROUP_NAMES = tuple(g.value for g in Group)
WORLD_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# each view: (layout, first dim, end dim) in the row-major layout "world" (WORLD_DIMS) or
# "expert" (pp, dp_replicate, expert, ep)
_VIEWS = {
    "world": ("world", 0, 5),
    "pp": ("world", 0, 1),
    "dp_replicate": ("world", 1, 2),
    "dp_shard": ("world", 2, 3),
    "cp": ("world", 3, 4),
    "tp": ("world", 4, 5),
    "batch": ("world", 1, 3),
    "loss": ("world", 1, 4),
    "dense": ("world", 2, 4),
    "expert": ("expert", 2, 3),
    "ep": ("expert", 3, 4),
}
# the DeviceMesh dims of the two parameter layouts; fully_shard and TP slice these, so that their meshes
# share one root as FSDP2 requires of a DTensor parameter sharded by both
_MESH_DIMS = {
    "dense": ("pp", "dp_replicate", "dense", "tp"),
    "expert": ("pp", "dp_replicate", "expert", "ep"),
}


def check_group_name(name: str) -> str:
    """`name` if it names a group of the mesh; a ValueError listing the names otherwise."""
    if name not in GROUP_NAMES:
        raise ValueError(f"group {name!r} is unknown; allowed: {', '.join(GROUP_NAMES)}")
    return name


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension; `dp_shard=-1` takes the rest of the world (see `resolve`)."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __str__(self) -> str:
        shape = " x ".join(f"{d}={getattr(self, d)}" for d in WORLD_DIMS if getattr(self, d) != 1)
        return (shape or "dp_shard=1") + (f", ep={self.ep}" if self.ep != 1 else "")

    def resolve(self, world_size: int) -> ParallelDims:
        """These degrees with dp_shard=-1 filled in; a one-line ValueError if they do not fit
        `world_size` processes (called before spawning, so a bad mesh starts nothing)."""
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is invalid; allowed: an int >= 1")
        for dim in ("dp_replicate", "cp", "tp", "pp", "ep"):
            value = getattr(self, dim)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{dim}={value!r} is invalid; allowed: an int >= 1")
        if not _is_int(self.dp_shard) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(
                f"dp_shard={self.dp_shard!r} is invalid; allowed: an int >= 1, or -1 for the rest of the world"
            )
        others = self.dp_replicate * self.cp * self.tp * self.pp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"parallel dims {self}: the others make {others} ranks, which does not divide the world of "
                    f"{world_size} processes; allowed: others whose product divides {world_size} (dp_shard=-1 "
                    "takes the rest)"
                )
            dp_shard = world_size // others
        elif others * dp_shard != world_size:
            raise ValueError(
                f"parallel dims {self} make {others * dp_shard} ranks but the world has {world_size} processes; "
                f"allowed: degrees whose product is {world_size}, or dp_shard=-1 to take the rest"
            )
        spanned = dp_shard * self.cp * self.tp
        if spanned % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide dp_shard*cp*tp = {spanned} ({self}); allowed: a divisor of "
                f"{spanned} (expert parallelism reuses those ranks)"
            )
        return dataclasses.replace(self, dp_shard=dp_shard)

    # ---- which ranks share a group: arithmetic on the layout, no process group needed -------------
    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, d) for d in WORLD_DIMS)

    def size(self, name: str) -> int:
        """How many ranks one group of view `name` holds."""
        return self._stride_and_size(name)[1]

    def ranks(self, name: str, rank: int) -> list[int]:
        """The global ranks in the group of view `name` that holds global rank `rank`."""
        stride, size = self._stride_and_size(name)
        first = rank - (rank // stride % size) * stride
        return [first + i * stride for i in range(size)]

    def index(self, name: str, rank: int) -> int:
        """Global rank `rank`'s index within its group of view `name`."""
        stride, size = self._stride_and_size(name)
        return rank // stride % size

    def groups(self, name: str) -> list[list[int]]:
        """Every group of view `name` (they partition the world), ordered by their first rank."""
        stride, size = self._stride_and_size(name)
        return [self.ranks(name, r) for r in range(self.world_size) if r // stride % size == 0]

    def _stride_and_size(self, name: str) -> tuple[int, int]:
        if self.dp_shard == -1:
            raise RuntimeError(f"parallel dims {self} are not resolved; call resolve(world_size) first")
        layout, start, end = _VIEWS[check_group_name(name)]
        shape = [getattr(self, d) for d in WORLD_DIMS]
        if layout == "expert":
            shape = [self.pp, self.dp_replicate, self.dp_shard * self.cp * self.tp // self.ep, self.ep]
        return math.prod(shape[end:]), math.prod(shape[start:end])

    def describe(self) -> str:
        """One line: the degrees, then the groups of every view of more than one rank (views with the
        same groups share an entry; big worlds are abbreviated)."""
        names_by_groups: dict[tuple[tuple[int, ...], ...], list[str]] = {}
        for name in GROUP_NAMES[1:]:  # "world" is every rank: the header says how many
            if self.size(name) > 1:
                key = tuple(map(tuple, self.groups(name)))
                names_by_groups.setdefault(key, []).append(name)
        views = [f"{'='.join(names)} {_groups_text(groups)}" for groups, names in names_by_groups.items()]
        return f"mesh {self} (world {self.world_size})" + (": " + " | ".join(views) if views else "")

    def build(self, device_type: str, timeout: datetime.timedelta | None = None) -> ParallelMesh:
        """This rank's named groups and meshes; call on every rank, after the default process group exists."""
        return ParallelMesh(self.resolve(dist.get_world_size()), device_type, timeout)


class ParallelMesh:
    """The process groups and DeviceMeshes of resolved ParallelDims, as seen by this rank."""

    def __init__(self, dims: ParallelDims, device_type: str, timeout: datetime.timedelta | None) -> None:
        self.dims, self.device_type = dims, device_type
        self.global_rank = dist.get_rank()
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._meshes: dict[str, DeviceMesh] = {}
        self._roots: dict[str, DeviceMesh] = {}
        # Groups come from dist.new_group, not init_device_mesh + _flatten/_unflatten: DeviceMesh makes a
        # group per mesh dim and again per unflatten (TorchTitan's build_mesh notes the duplicates), and
        # expert/ep are no product of world dims. Here each distinct partition is made once (without cp,
        # loss and batch are one group; dense and dp_shard another) and the whole world reuses the default
        # group. All size-1 views share one single-rank group, made here too (no peer to connect to, so
        # cheap) because a group made later by one rank alone would shift the names of groups made after
        # it; the strategy skips collectives on size-1 views. DeviceMesh.from_group wraps what FSDP/TP need.
        made: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup] = {}
        for name in GROUP_NAMES:
            partition = tuple(map(tuple, dims.groups(name)))
            if partition not in made:
                made[partition] = self._new_group(name, partition, timeout)
            self._groups[name] = made[partition]

    def _new_group(
        self, name: str, partition: tuple[tuple[int, ...], ...], timeout: datetime.timedelta | None
    ) -> dist.ProcessGroup:
        if len(partition) == 1:
            return dist.group.WORLD
        mine = None
        for ranks in partition:  # new_group is collective over the world: every rank makes every group
            group = dist.new_group(list(ranks), timeout=timeout, group_desc=f"mesh_{name}")
            if self.global_rank in ranks:
                mine = group
        return mine

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of view `name` that holds this rank."""
        return self._groups[check_group_name(name)]

    def rank(self, name: str) -> int:
        """This rank's index within its group of view `name`."""
        return self.dims.index(name, self.global_rank)

    def size(self, name: str) -> int:
        """How many ranks this rank's group of view `name` holds."""
        return self.dims.size(name)

    def ranks(self, name: str) -> list[int]:
        """The global ranks in this rank's group of view `name`."""
        return self.dims.ranks(name, self.global_rank)

    def describe(self) -> str:
        """One line naming the degrees and which ranks share which group."""
        return self.dims.describe()

    def mesh(self, name: str) -> DeviceMesh:
        """The DeviceMesh of view `name`. "dense" and "expert" are what fully_shard takes: 1-D, or 2-D
        (dp_replicate, shard) for hybrid sharding when dp_replicate > 1; "tp" and "ep" are sliced from
        the same root as them. Other views are 1-D meshes of their group."""
        if check_group_name(name) not in self._meshes:
            self._meshes[name] = self._make_mesh(name)
        return self._meshes[name]

    def _make_mesh(self, name: str) -> DeviceMesh:
        if name in _MESH_DIMS:
            root = self._root(name)
            return root[("dp_replicate", name)] if self.size("dp_replicate") > 1 else root[name]
        for layout in _MESH_DIMS:
            if name in self._root_dims(layout):
                return self._root(layout)[name]
        return DeviceMesh.from_group(self.group(name), self.device_type, mesh_dim_names=(name,))

    def _root_dims(self, layout: str) -> list[str]:
        """`layout`'s dims of more than one rank, and its shard dim, which fully_shard needs even of
        size 1 (to apply mixed precision)."""
        return [n for n in _MESH_DIMS[layout] if n == layout or self.size(n) > 1]

    def _root(self, layout: str) -> DeviceMesh:
        """Every rank in `layout`'s dims, each dim backed by the view of the same name."""
        if layout not in self._roots:
            names = self._root_dims(layout)
            ranks = torch.arange(self.dims.world_size).reshape([self.size(n) for n in names])
            self._roots[layout] = DeviceMesh.from_group(
                [self._groups[n] for n in names], self.device_type, mesh=ranks, mesh_dim_names=tuple(names)
            )
        return self._roots[layout]


def _groups_text(groups: tuple[tuple[int, ...], ...]) -> str:
    """`[0,2] [1,3]`; past four groups, or four ranks in a group, the middle is elided (the groups of a
    view are arithmetic progressions, so the ends say the rest)."""

    def one(ranks: tuple[int, ...]) -> str:
        shown = ranks if len(ranks) <= 4 else (ranks[0], ranks[1], "..", ranks[-1])
        return "[" + ",".join(map(str, shown)) + "]"

    if len(groups) <= 4:
        return " ".join(map(one, groups))
    return f"{one(groups[0])} .. {one(groups[-1])} ({len(groups)} groups)"
