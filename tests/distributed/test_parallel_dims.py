"""ParallelDims: validation before spawning, and the named groups of real gloo meshes."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import call_ranks, join_world

from strategies import MeshStrategy, ParallelDims, SingleDeviceStrategy
from strategies.parallel_dims import GROUP_NAMES
from trainer import Trainer
from trainer.config import build_run, load_recipe
from trainer.core.precision import Precision

RECIPES = Path(__file__).parents[2] / "recipes"

WORLD_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# the coordinates that stay fixed within one group of each view (see expected_groups)
FIXED = {
    "world": (),
    "pp": ("dp_replicate", "dp_shard", "cp", "tp"),
    "dp_replicate": ("pp", "dp_shard", "cp", "tp"),
    "dp_shard": ("pp", "dp_replicate", "cp", "tp"),
    "cp": ("pp", "dp_replicate", "dp_shard", "tp"),
    "tp": ("pp", "dp_replicate", "dp_shard", "cp"),
    "batch": ("pp", "cp", "tp"),
    "loss": ("pp", "tp"),
    "dense": ("pp", "dp_replicate", "tp"),
    "expert": ("pp", "dp_replicate", "ep"),
    "ep": ("pp", "dp_replicate", "efsdp"),
}


class MeshOf(MeshStrategy):
    """A MeshStrategy with the given parallel degrees."""

    def __init__(self, **degrees: int) -> None:
        super().__init__(timeout_s=60)
        self.degrees = degrees

    def parallel_dims(self) -> ParallelDims:
        return ParallelDims(**self.degrees)


def expected_groups(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1) -> dict[str, list[list[int]]]:
    """view -> rank -> the ranks of its group, from each rank's coordinates in the row-major world
    (pp, dp_replicate, dp_shard, cp, tp): a group holds the ranks equal to it in the FIXED coordinates.
    Experts split the dp_shard x cp x tp ranks of a replica into (efsdp, ep), ep innermost."""
    coords = []
    for c in itertools.product(range(pp), range(dp_replicate), range(dp_shard), range(cp), range(tp)):
        at = dict(zip(WORLD_DIMS, c, strict=True))
        inner = (at["dp_shard"] * cp + at["cp"]) * tp + at["tp"]
        coords.append({**at, "efsdp": inner // ep, "ep": inner % ep})
    return {
        view: [
            [s for s, other in enumerate(coords) if all(other[k] == mine[k] for k in fixed)]
            for mine in coords
        ]
        for view, fixed in FIXED.items()
    }


# ---- validation, before any process exists ------------------------------------------------------------
@pytest.mark.parametrize(
    "degrees, world, dp_shard",
    [
        ({}, 1, 1),
        ({}, 8, 8),
        ({"pp": 2, "dp_shard": 2, "tp": 2}, 8, 2),
        ({"pp": 2, "tp": 2}, 8, 2),
        ({"dp_replicate": 2, "cp": 2, "ep": 4}, 16, 4),
        ({"dp_replicate": 8, "dp_shard": 1}, 8, 1),
        ({"tp": 4, "ep": 4}, 4, 1),
    ],
)
def test_resolve_fills_dp_shard_with_the_rest_of_the_world(degrees, world, dp_shard):
    resolved = ParallelDims(**degrees).resolve(world)
    assert resolved == ParallelDims(**{**degrees, "dp_shard": dp_shard})
    assert resolved.world_size == world


@pytest.mark.parametrize(
    "degrees, world, message",
    [
        (
            {"pp": 2, "dp_shard": 2, "tp": 2},
            4,
            "parallel dims pp=2 x dp_shard=2 x tp=2 make 8 ranks but the world has 4",
        ),
        ({"dp_shard": 3}, 4, "parallel dims dp_shard=3 make 3 ranks but the world has 4 processes"),
        (
            {"tp": 3},
            8,
            "parallel dims dp_shard=-1 x tp=3: the others make 3 ranks, which does not divide the world of 8",
        ),
        ({"tp": 2, "ep": 3}, 4, r"ep=3 does not divide dp_shard\*cp\*tp = 4"),
        ({"dp_replicate": 2, "dp_shard": 2, "ep": 4}, 4, r"ep=4 does not divide dp_shard\*cp\*tp = 2"),
        ({"tp": 0}, 4, "tp=0 is invalid; allowed: an int >= 1"),
        ({"pp": 2.0}, 4, "pp=2.0 is invalid; allowed: an int >= 1"),
        ({"cp": True}, 4, "cp=True is invalid; allowed: an int >= 1"),
        ({"ep": "2"}, 4, "ep='2' is invalid; allowed: an int >= 1"),
        ({"dp_shard": -2}, 4, "dp_shard=-2 is invalid; allowed: an int >= 1, or -1 for the rest"),
        ({"dp_shard": 0}, 4, "dp_shard=0 is invalid"),
        ({}, 0, "world_size=0 is invalid; allowed: an int >= 1"),
    ],
)
def test_degrees_that_do_not_fit_the_world_are_named_in_one_line(degrees, world, message):
    with pytest.raises(ValueError, match=message) as err:
        ParallelDims(**degrees).resolve(world)
    assert "\n" not in str(err.value)


def test_a_mesh_that_does_not_fit_fails_in_the_trainer_constructor_before_spawning():
    with pytest.raises(ValueError, match="pp=2 x dp_shard=2 x tp=2 make 8 ranks but the world has 4"):
        Trainer(strategy=MeshOf(pp=2, dp_shard=2, tp=2), accelerator="cpu", devices=4)
    with pytest.raises(ValueError, match=r"ep=3 does not divide dp_shard\*cp\*tp = 4"):
        Trainer(strategy=MeshOf(tp=2, ep=3), accelerator="cpu", devices=4)


def test_the_global_batch_is_split_over_the_batch_group_not_the_process_count():
    """With tp=2 on 4 processes only 2 ranks read different data: a recipe's global batch of 16 is 8 per
    reading rank, and the start-up line's data-parallel size is 2."""
    from trainer.config import _micro_batch

    trainer = Trainer(strategy=MeshOf(tp=2), accelerator="cpu", devices=4)
    assert trainer.strategy.planned_group_size("batch") == 2
    assert trainer.strategy.planned_group_size("world") == 4
    data = {"global_batch_size": 16, "batch_size": None}
    assert (
        _micro_batch(data, {"accumulate_grad_batches": 1}, trainer.strategy.planned_group_size("batch")) == 8
    )


@pytest.mark.parametrize(
    "degrees, world",
    [
        ({"pp": 2, "dp_shard": 2, "tp": 2}, 8),
        ({"dp_replicate": 2, "dp_shard": 3, "cp": 2, "tp": 2, "ep": 4}, 24),
        ({"pp": 3, "dp_shard": 2, "cp": 2, "ep": 2}, 12),
        ({"dp_replicate": 4, "dp_shard": 1}, 4),
    ],
)
def test_group_arithmetic_matches_the_coordinates_of_each_rank(degrees, world):
    dims = ParallelDims(**degrees).resolve(world)
    expected = expected_groups(**degrees)
    for name in GROUP_NAMES:
        assert dims.groups(name) == sorted(map(list, {tuple(g) for g in expected[name]})), name
        for rank in range(world):
            assert dims.ranks(name, rank) == expected[name][rank], (name, rank)
            assert dims.index(name, rank) == expected[name][rank].index(rank), (name, rank)


def test_describe_names_which_ranks_share_which_group_in_one_line():
    dims = ParallelDims(pp=2, dp_shard=2, tp=2).resolve(8)
    assert dims.describe() == (
        "mesh pp=2 x dp_shard=2 x tp=2 (world 8): batch=loss=dense=dp_shard [0,2] [1,3] [4,6] [5,7] | "
        "expert [0,1,2,3] [4,5,6,7] | tp [0,1] [2,3] [4,5] [6,7] | pp [0,4] [1,5] [2,6] [3,7]"
    )
    big = ParallelDims(dp_replicate=4, tp=8, ep=8).resolve(1024).describe()
    assert "\n" not in big and len(big) < 400, big
    assert "dense=expert=dp_shard [0,8,..,248] .. [775,783,..,1023] (32 groups)" in big
    assert ParallelDims().resolve(1).describe() == "mesh dp_shard=1 (world 1)"


def test_an_unknown_group_name_lists_the_allowed_ones():
    allowed = "allowed: world, batch, loss, dense, expert, ep, dp_replicate, dp_shard, cp, tp, pp"
    with pytest.raises(ValueError, match=f"group 'data' is unknown; {allowed}"):
        ParallelDims().resolve(2).ranks("data", 0)
    one = SingleDeviceStrategy()
    with pytest.raises(ValueError, match="group 'dp' is unknown"):
        one.reduce(torch.ones(()), "sum", group="dp")
    with pytest.raises(TypeError, match="group"):
        one.reduce(torch.ones(()), "sum")  # the group is required: no reduction over "everyone" by default
    assert (one.group_rank("tp"), one.group_size("loss"), one.dp_rank, one.dp_size) == (0, 1, 0, 1)


def test_an_unknown_reduce_op_is_refused_in_one_process_too():
    """A callback's reduce with a typo fails on a laptop, not first on a multi-GPU run."""
    with pytest.raises(ValueError, match="reduce op 'avg' is unknown; allowed: mean, sum, max, min"):
        SingleDeviceStrategy().reduce(torch.ones(()), "avg", group="world")


def test_object_collectives_and_the_barrier_default_to_the_world_in_one_process_too():
    """A callback may leave out the group of all_gather_object, broadcast_object and barrier: the whole
    world, in one process as in a multi-process run."""
    one = SingleDeviceStrategy()
    assert one.all_gather_object({"step": 3}) == [{"step": 3}]
    assert one.broadcast_object("step-00000003") == "step-00000003"
    one.barrier()


def test_in_one_process_a_recipe_s_global_batch_is_split_over_the_accumulation_only(tmp_path):
    """One process reads all the data: data.global_batch_size=12 with 2 accumulated micro-batches makes
    micro-batches of 6."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    overrides = [
        f"data.path={corpus}",
        "data.seq_len=64",
        "data.global_batch_size=12",
        "trainer.accumulate_grad_batches=2",
        f"trainer.default_root_dir={tmp_path / 'run'}",
        *("model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"),
    ]
    trainer, _, train_loader, _ = build_run(load_recipe(RECIPES / "llama_tiny.yaml", overrides))
    assert trainer.strategy.world_size == 1 and train_loader.batch_size == 6


# ---- real process groups --------------------------------------------------------------------------------
def _check_rank(rank: int, world: int, port: int, degrees: dict[str, int]) -> None:
    """One rank: build the mesh through MeshStrategy, then compare every named group with the expected
    ranks, both as computed and as the process group really holds them."""
    join_world(rank, world, port)  # as under torchrun (the self-spawn path is tested elsewhere)
    strategy = MeshOf(**degrees)
    strategy.configure("cpu", world, 1, Precision("32"))
    strategy.setup_environment()
    mesh = strategy.mesh
    expected = expected_groups(**{**degrees, "dp_shard": mesh.dims.dp_shard})
    wrong = []
    for name in GROUP_NAMES:
        want = expected[name][rank]
        # the sum of 2**rank over a group is the bitmask of its members: proves the real group's members
        mask = int(strategy.reduce(torch.tensor(2.0**rank, dtype=torch.float64), "sum", group=name))
        got = {
            "ranks": mesh.ranks(name),
            "process group": dist.get_process_group_ranks(mesh.group(name)),
            "all_reduce": [r for r in range(world) if mask >> r & 1],
            "index": strategy.group_rank(name),
            "size": strategy.group_size(name),
        }
        for what, value in got.items():
            should = {"index": want.index(rank), "size": len(want)}.get(what, want)
            if value != should:
                wrong.append(f"rank {rank} group {name!r}: {what} {value}, expected {should}")
    for name in ("dense", "expert", "tp", "ep"):  # the DeviceMeshes fully_shard and TP take
        got = sorted(mesh.mesh(name).mesh.flatten().tolist())
        if got != expected[name][rank]:
            wrong.append(f"rank {rank} mesh {name!r}: ranks {got}, expected {expected[name][rank]}")
    # raise now: the object collectives below assume the groups are right (spawn then stops the others)
    assert not wrong, "; ".join(wrong)
    tp = strategy.all_gather_object(rank, group="tp")
    assert tp == expected["tp"][rank], f"rank {rank} all_gather_object over 'tp': {tp}"
    first = expected["batch"][rank][0]
    got = strategy.broadcast_object(rank, src=first, group="batch")
    assert got == first, f"rank {rank} broadcast_object over 'batch' from rank {first}: got {got}"
    strategy.barrier(group="loss")


@pytest.mark.slow
# 4 ranks, three dimensions; 8-rank meshes (pp x dp_shard x tp) are built for real by test_parallel3d's
# 2x2x2 run and their layouts checked above without processes (8 more processes cost ~40 s of suite time)
@pytest.mark.parametrize(
    "world, degrees", [(4, {"dp_shard": 2, "cp": 2, "ep": 2})], ids=["dp_shard2-cp2-ep2"]
)
def test_every_named_group_of_a_real_gloo_mesh_holds_the_expected_ranks(world, degrees):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # bound on a port it picks
    call_ranks(_check_rank, world, world, store.port, degrees)
