"""Which ranks the doctor measures together: the world, the node split (ranks of one node; one rank per
node with the same local rank, as the ring between nodes runs), and each dimension of a given mesh."""

from __future__ import annotations

import dataclasses

from strategies.parallel_dims import WORLD_DIMS, ParallelDims

INTRA, INTER = "intra_node", "inter_node"


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """One named way of cutting the world into groups that run a collective at the same time."""

    name: str
    groups: tuple[tuple[int, ...], ...]  # they partition the world; every group has the same size

    @property
    def size(self) -> int:
        return len(self.groups[0])


def node_layouts(world_size: int, gpus_per_node: int) -> list[GroupLayout]:
    """The ranks of each node, and the ranks of each local rank across nodes; none if one node holds all."""
    if gpus_per_node >= world_size:
        return []
    nodes = world_size // gpus_per_node
    intra = tuple(tuple(range(n * gpus_per_node, (n + 1) * gpus_per_node)) for n in range(nodes))
    inter = tuple(tuple(range(local, world_size, gpus_per_node)) for local in range(gpus_per_node))
    return [layout for layout in (GroupLayout(INTRA, intra), GroupLayout(INTER, inter)) if layout.size > 1]


def mesh_layouts(dims: ParallelDims) -> list[GroupLayout]:
    """Each dimension of resolved `dims` (and ep) of more than one rank and less than the world."""
    names = [*WORLD_DIMS, "ep"]
    layouts = []
    for name in names:
        size = dims.size(name)
        if 1 < size < dims.world_size:
            layouts.append(GroupLayout(name, tuple(map(tuple, dims.groups(name)))))
    return layouts


def parse_mesh(text: str) -> ParallelDims:
    """ParallelDims from 'dp_shard=2,tp=2' (unnamed dimensions 1, dp_shard -1 unless given)."""
    fields = {f.name for f in dataclasses.fields(ParallelDims)}
    degrees: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in fields or not value.strip().lstrip("-").isdigit():
            raise ValueError(
                f"--mesh {text!r}: {part!r} is invalid; allowed: comma-separated DIM=N with DIM one of "
                f"{', '.join(sorted(fields))}"
            )
        degrees[name.strip()] = int(value)
    return ParallelDims(**degrees)


def check_gpus_per_node(gpus_per_node: int, world_size: int) -> int:
    """`gpus_per_node` if it divides the world; a one-line ValueError otherwise."""
    if gpus_per_node < 1 or world_size % gpus_per_node:
        raise ValueError(
            f"--gpus-per-node {gpus_per_node} does not divide the world of {world_size} processes; allowed: a "
            f"divisor of {world_size}"
        )
    return gpus_per_node
