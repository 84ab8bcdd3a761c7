"""The doctor's sharding overheads from timed rounds (trainer/doctor/sharded_overhead.py `overhead_of`): a
line over the depths per round, less the wire time, the median over rounds."""

import pytest

from trainer.doctor.sharded_overhead import BLOCKS, Round, overhead_of

# seconds the sharding adds: per block pass, per model pass, per optimizer step and block, per step
TRUE = (0.025, 0.010, 0.020, 0.005)
BLOCK_WIRE, ROOT_WIRE = 0.004, 0.002


def timed(speed: float, split: int, shards: int) -> Round:
    """A round on a host running at 1/`speed` of its usual pace: every arm's time scaled alike, the
    collectives' wire time not (it is measured in the same round and taken out as measured)."""
    block, fixed, step_block, step = TRUE
    whole_pass = [speed * (0.003 * b + 0.002) for b in BLOCKS]
    whole_step = [speed * (0.001 * b + 0.0005) for b in BLOCKS]
    return Round(
        sharded_pass=tuple(
            w / split + speed * (block * b + fixed) + BLOCK_WIRE * b + ROOT_WIRE
            for b, w in zip(BLOCKS, whole_pass, strict=True)
        ),
        whole_pass=tuple(whole_pass),
        sharded_step=tuple(
            w / shards + speed * (step_block * b + step) for b, w in zip(BLOCKS, whole_step, strict=True)
        ),
        whole_step=tuple(whole_step),
        block_wire=BLOCK_WIRE,
        root_wire=ROOT_WIRE,
    )


@pytest.mark.parametrize("split", [1, 2])  # FSDP keeps a pass's compute, tensor parallelism splits it
def test_the_median_round_outvotes_a_host_that_slowed_for_one_round(split):
    rounds = [timed(speed, split, shards=2) for speed in (1.0, 0.9, 2.5, 1.1, 1.0)]
    assert overhead_of(rounds, split=split, shards=2) == pytest.approx(TRUE, rel=1e-9)


def test_a_steady_host_gives_the_costs_of_any_one_round():
    got = overhead_of([timed(1.0, 2, 2)], split=2, shards=2)
    assert got == pytest.approx(TRUE, rel=1e-9)
    assert len(BLOCKS) >= 2 and len(set(BLOCKS)) == len(BLOCKS)  # a line needs two depths
