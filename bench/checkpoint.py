"""What checkpoints cost, at 1, 2 and 4 ranks on this CPU, and what that projects to for the 8B and 70B
recipes' states.

Part 1 (ranks): a state of STATE_MB split evenly over N gloo processes is saved the way a sharded strategy
saves it (torch.distributed.checkpoint, each rank its own file, hashed while written), then verified (each
rank hashes its contiguous share of the blocks). Per N: save GB/s, in-memory hash GB/s, verify GB/s of the
whole state, and the verify time as a ratio of one rank's. The baseline is what the checkpoints did
before: rank zero re-reads every file and hashes it with SHA-256, on one core.
Part 2 (recipes): the 8B and 70B recipes' AdamW state (fp32 weights + 2 moments: 12 bytes per parameter)
split over their GPUs, at this machine's measured per-rank rates. Reads come from the page cache here
(the files were just written), so verify rates are an upper bound for a cold disk.

    python bench/checkpoint.py [--mb 768]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import xxhash

from strategies.checkpoint_io.dcp_files import HashingWriter
from trainer.checkpoint import integrity
from trainer.config import build_llama_config, load_recipe
from trainer.models.llama import Llama

RECIPES = Path(__file__).parents[1] / "recipes"
TENSOR_MB = 16  # the state is made of tensors of this size, like a model's layers
ROUNDS = 5


def worker(rank: int, world: int, store_dir: str, ckpt_dir: str, total_bytes: int, out: dict) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    n = total_bytes // world // (TENSOR_MB << 20)
    g = torch.Generator().manual_seed(rank)
    state = {f"r{rank}.t{i}": torch.randn((TENSOR_MB << 20) // 4, generator=g) for i in range(n)}
    mine = sum(t.numel() * 4 for t in state.values())

    dist.barrier()
    start = time.perf_counter()
    h = xxhash.xxh3_128()
    for t in state.values():
        h.update(t.numpy())
    hash_s = time.perf_counter() - start

    writer = HashingWriter(Path(ckpt_dir))
    dist.barrier()
    start = time.perf_counter()
    dcp.save(state, storage_writer=writer)
    dist.barrier()
    save_s = time.perf_counter() - start

    entries: list = [None] * world
    dist.all_gather_object(entries, writer.entries)
    manifest = {k: v for e in entries for k, v in e.items()}
    mine_units = integrity.share(integrity.units(manifest), rank, world)
    verify_s = float("inf")
    for _ in range(ROUNDS):  # best of: the verify of a few hundred MB takes a tenth of a second
        dist.barrier()
        start = time.perf_counter()
        problem = integrity.first_mismatch(Path(ckpt_dir), mine_units)
        dist.barrier()
        verify_s = min(verify_s, time.perf_counter() - start)
        assert problem is None, problem
    times = [None] * world
    dist.all_gather_object(times, (mine, hash_s))
    if rank == 0:
        out.update(
            save_s=save_s, verify_s=verify_s, total=sum(b for b, _ in times), hash_s=max(s for _, s in times)
        )
        sha_start = time.perf_counter()
        for name in manifest:
            with open(Path(ckpt_dir) / name, "rb") as f:
                hashlib.file_digest(f, "sha256")
        out["sha256_s"] = time.perf_counter() - sha_start
    dist.destroy_process_group()


def measure(world: int, total_bytes: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = mp.Manager().dict()
        mp.spawn(worker, args=(world, tmp, os.path.join(tmp, "ckpt"), total_bytes, out), nprocs=world)
        return dict(out)


def recipe_state(name: str) -> tuple[int, int]:
    """(AdamW state bytes of the recipe's model, its GPUs)."""
    recipe = load_recipe(RECIPES / name)
    with torch.device("meta"):
        params = sum(p.numel() for p in Llama(build_llama_config(recipe["model"])).parameters())
    t = recipe["trainer"]
    return 12 * params, t["devices"] * t["num_nodes"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=768, help="state size in MB (split over the ranks)")
    a = p.parse_args()
    total = a.mb << 20
    print(f"state of {a.mb} MB, {TENSOR_MB} MB tensors; {os.cpu_count()} CPU cores; gloo processes")
    print(
        f"{'ranks':>5} {'save GB/s':>10} {'hash GB/s':>10} {'verify GB/s':>12} {'verify s':>9} {'vs 1 rank':>10}"
    )
    results = {}
    for world in (1, 2, 4):
        r = results[world] = measure(world, total)
        gb = r["total"] / 1e9
        print(
            f"{world:>5} {gb / r['save_s']:>10.2f} {gb / r['hash_s']:>10.2f} "
            f"{gb / r['verify_s']:>12.2f} {r['verify_s']:>9.3f} {r['verify_s'] / results[1]['verify_s']:>10.2f}"
        )
    one = results[1]
    sha_rate = one["total"] / one["sha256_s"]
    print(f"baseline: rank zero re-reading and SHA-256-hashing every file: {sha_rate / 1e9:.2f} GB/s")
    four = results[4]
    save_rate, verify_rate = four["total"] / four["save_s"] / 4, four["total"] / four["verify_s"] / 4
    print(f"\nprojection at this machine's 4-rank per-rank rates (save {save_rate / 1e9:.2f}, verify "
          f"{verify_rate / 1e9:.2f} GB/s per rank) vs the old rank-zero SHA-256 pass:")  # fmt: skip
    print(
        f"{'recipe':>16} {'state GB':>9} {'GPUs':>5} {'GB/rank':>8} {'save s':>7} {'verify s':>9} {'old pass s':>11}"
    )
    for name in ("llama_8b.yaml", "llama_70b.yaml"):
        state, gpus = recipe_state(name)
        per = state / gpus
        print(
            f"{name:>16} {state / 1e9:>9.1f} {gpus:>5} {per / 1e9:>8.2f} {per / save_rate:>7.1f} "
            f"{per / verify_rate:>9.1f} {state / sha_rate:>11.0f}"
        )


if __name__ == "__main__":
    main()
