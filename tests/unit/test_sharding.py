"""Data-parallel sharding of user DataLoaders, and the checks made before any process is spawned."""

import io
import logging

import pytest
import torch
from helpers import regression_data
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from strategies import DDPStrategy
from trainer import Trainer
from trainer.core.launch import detect_world, expand_nodelist
from trainer.data.distributed import shard_loader


def indices(loader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


def numbered(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


@pytest.mark.parametrize("shuffle", [False, True])
def test_map_style_shards_are_disjoint_and_cover_the_epoch(shuffle):
    loader = DataLoader(numbered(64), batch_size=4, shuffle=shuffle)
    shards = [shard_loader(loader, r, 4, seed=0) for r in range(4)]
    seen = [indices(s) for s in shards]
    assert all(len(s) == 16 for s in seen)
    assert sorted(i for s in seen for i in s) == list(range(64))


def test_shuffle_differs_per_epoch_and_repeats_for_the_same_seed():
    def epoch_order(epoch: int, seed: int) -> list[int]:
        loader = shard_loader(DataLoader(numbered(64), batch_size=8, shuffle=True), 0, 2, seed=seed)
        loader.sampler.set_epoch(epoch)
        return indices(loader)

    assert epoch_order(0, seed=1) == epoch_order(0, seed=1)
    assert epoch_order(0, seed=1) != epoch_order(1, seed=1)


def test_uneven_tail_is_padded_or_dropped_so_ranks_have_equal_batches():
    kept = [
        indices(shard_loader(DataLoader(numbered(10), batch_size=2, drop_last=False), r, 4, 0))
        for r in range(4)
    ]
    assert {len(k) for k in kept} == {3} and set().union(*kept) == set(range(10))  # 2 samples repeated
    dropped = [
        indices(shard_loader(DataLoader(numbered(10), batch_size=2, drop_last=True), r, 4, 0))
        for r in range(4)
    ]
    assert {len(d) for d in dropped} == {2}


class Stream(IterableDataset):
    def __iter__(self):
        yield from (torch.tensor([i]) for i in range(10))


def test_iterable_datasets_are_shared_round_robin_in_whole_rounds():
    shards = [indices(shard_loader(DataLoader(Stream(), batch_size=1), r, 3, 0)) for r in range(3)]
    assert shards == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]  # item 9 starts an incomplete round: dropped


def test_custom_samplers_are_refused_with_what_to_do():
    loader = DataLoader(
        numbered(8), sampler=torch.utils.data.WeightedRandomSampler([1.0] * 8, 8), batch_size=2
    )
    with pytest.raises(
        ValueError, match="cannot shard a DataLoader with a custom sampler .*WeightedRandomSampler"
    ):
        shard_loader(loader, 0, 2, 0)


def test_one_rank_and_self_sharding_loaders_are_left_as_they_are():
    loader = DataLoader(regression_data(), batch_size=4)
    assert shard_loader(loader, 0, 1, 0) is loader


def test_slurm_nodelists_expand_in_order():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    world = detect_world(
        {
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_NODELIST": "node[7-8]",
            "SLURM_NTASKS_PER_NODE": "2(x2)",
            "SLURM_JOB_ID": "42",
        }
    )
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size, world.master_addr) == (
        3,
        1,
        4,
        2,
        "node7",
    )
    assert world.master_port == 15042  # derived from the job id: the same on every task of the job


def test_devices_that_do_not_match_the_running_job_are_refused(monkeypatch):
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
    }.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(
        ValueError,
        match="the torchrun job has 2 processes per node and 2 in all, but the Trainer has devices=3",
    ):
        Trainer(strategy="ddp", devices=3)
    assert Trainer(strategy="ddp").strategy.devices == 2  # devices="auto" takes the job's size


def test_multi_node_without_a_launcher_and_bf16_hooks_on_cpu_are_refused():
    with pytest.raises(ValueError, match="num_nodes=2 needs a launcher that starts every node"):
        Trainer(strategy="ddp", devices=1, num_nodes=2)
    with pytest.raises(ValueError, match="gradient_compression='bf16' needs CUDA with NCCL"):
        Trainer(strategy=DDPStrategy(gradient_compression="bf16"), devices=2)
    with pytest.raises(ValueError, match="gradient_compression='int8' is unknown"):
        DDPStrategy(gradient_compression="int8")
    with pytest.raises(ValueError, match="timeout_s=0 is invalid"):
        DDPStrategy(timeout_s=0)


def test_a_strategy_not_yet_given_to_a_trainer_plans_for_one_process_on_one_node():
    # the Trainer's defaults (devices=1, num_nodes=1) until a Trainer configures it
    strategy = DDPStrategy()
    assert strategy.world_size == 1 and strategy.planned_group_size("batch") == 1
    strategy.configure("cpu", 2, 1, strategy.precision)
    assert strategy.world_size == 2 and strategy.planned_group_size("batch") == 2


def test_other_ranks_print_only_warnings_prefixed_with_their_rank():
    from trainer.core.logging import configure_console_logging, log, set_rank

    configure_console_logging()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log.addHandler(handler)
    try:
        set_rank(1)
        log.info("hidden on rank 1")
        log.warning("visible")
        set_rank(0)
        log.info("shown on rank 0")
    finally:
        log.removeHandler(handler)
    assert stream.getvalue().splitlines() == ["[trainer rank 1] visible", "[trainer] shown on rank 0"]
