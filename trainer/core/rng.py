"""Seeding and capture/restore of every RNG a training run touches (python, numpy, torch CPU and CUDA)."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

# set by seed_everything(workers=True): an environment variable, as Lightning's, so that the processes a
# launch starts (which inherit the environment) seed their loaders' workers too
SEED_WORKERS_ENV = "TRAINER_SEED_WORKERS"
# the last seed_everything's seed (Lightning's PL_GLOBAL_SEED), inherited by the processes a launch starts
SEED_ENV = "TRAINER_GLOBAL_SEED"


def seed_everything(seed: int, workers: bool = False) -> int:
    """Seed python, numpy and torch (all devices) with `seed`; returns it. `workers=True` (Lightning's): the
    Trainer gives each DataLoader without a `worker_init_fn` one that seeds every worker from the seed, the
    worker id and the rank (`worker_init_function`)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r} is invalid; allowed: an int in [0, 2**32)")
    os.environ[SEED_WORKERS_ENV] = str(int(bool(workers)))
    os.environ[SEED_ENV] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def global_seed() -> int:
    """The seed of the last `seed_everything` (this process's or its launcher's), 0 without one: what seeds
    a fit's data sampling (its DistributedSampler) when the Trainer has no `seed`, as Lightning's."""
    return int(os.environ.get(SEED_ENV, 0))


def reset_seed() -> None:
    """Lightning's `reset_seed`: seed again with the last `seed_everything`'s seed and workers choice, if it
    was called (in this process or its launcher); what Lightning's parallel strategies do in every process
    when a stage sets up."""
    seed = os.environ.get(SEED_ENV)
    if seed is not None:
        seed_everything(int(seed), workers=seeds_workers())


def seeds_workers() -> bool:
    """Whether the last `seed_everything` asked for seeded loader workers."""
    return os.environ.get(SEED_WORKERS_ENV, "0") == "1"


def worker_init_function(worker_id: int, rank: int = 0) -> None:
    """Lightning's `pl_worker_init_function`: torch, python and numpy of a loader worker seeded from its base
    seed, its id and the global rank, so that no two workers of any rank draw the same numbers."""
    base_seed = torch.initial_seed() - worker_id  # torch gives worker i base_seed + i
    seeds = _seed_sequence(base_seed, worker_id, rank, count=4)
    torch.manual_seed(seeds[0])
    random.seed((seeds[1] << 32) | seeds[2])
    np.random.seed(np.random.SeedSequence([base_seed, worker_id, rank]).generate_state(4))


def _seed_sequence(base_seed: int, worker_id: int, rank: int, count: int) -> list[int]:
    """`count` 64-bit seeds: the three numbers packed into one, mixed by MurmurHash3's finalizer (so small
    seeds still fill the low bits), then drawn from a 64-bit LCG with Knuth's multiplier (Lightning's)."""
    mask = (1 << 64) - 1
    x = (base_seed << 32) | (worker_id << 16) | rank
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & mask
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & mask
    x ^= x >> 33
    seeds = []
    for _ in range(count):
        x = (x * 6364136223846793005 + 1) & mask
        seeds.append(x)
    return seeds


def rng_state() -> dict[str, Any]:
    """All RNG states as tensors, ints and lists only, so `torch.load(weights_only=True)` can read them back."""
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Run a block (e.g. validation) without moving the training RNG streams, so it never changes the run."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)
