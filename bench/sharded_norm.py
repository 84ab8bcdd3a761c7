"""The gradients' norm under FSDP2 / HSDP: the DTensor norm (torch's `get_total_norm` on the DTensors, then
`full_tensor`) against `strategies.gradients.sharded_norm` (each shard's norm squared, one all-reduce over
the shard group, the roots' norm: the same bits), which ParallelStrategy's clipping and logging take.

Gradients shaped as a small Llama's (per block: 4 attention and 3 MLP matrices, 2 norm weights; then the
embedding, the output and the final norm), sharded on dim 0 over a 1-D mesh of 2 and 4 gloo processes and a
2 x 2 (replicate x shard) one. Each layout times both norms alternately, `--reps` calls each after a
warm-up, and prints the median ms per call and the ratio; it checks the two norms' bits are equal.

Run: .venv/bin/python bench/sharded_norm.py [--blocks 8] [--width 256] [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYOUTS = {"fsdp over 2": (2, (2,)), "fsdp over 4": (4, (4,)), "hsdp 2 x 2": (4, (2, 2))}


def shapes(blocks: int, width: int) -> list[tuple[int, ...]]:
    """A Llama-like model's parameter shapes (vocab 4 x width, MLP 8/3 x width)."""
    hidden, vocab = 8 * width // 3, 4 * width
    block = [(width, width)] * 4 + [(hidden, width), (hidden, width), (width, hidden), (width,), (width,)]
    return [(vocab, width)] + block * blocks + [(width,), (vocab, width)]


def rank_main(
    rank: int, world: int, mesh_shape: tuple[int, ...], port: int, args: argparse.Namespace
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from strategies.gradients import shard_group, sharded_norm

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Replicate()] * (len(mesh_shape) - 1) + [Shard(0)]
    torch.manual_seed(0)
    grads = [distribute_tensor(torch.randn(s), mesh, placements) for s in shapes(args.blocks, args.width)]
    group = shard_group(grads)
    ways = {
        "dtensor": lambda: torch.nn.utils.get_total_norm(grads, 2.0).full_tensor(),
        "sharded": lambda: sharded_norm(grads, group),
    }
    assert torch.equal(ways["dtensor"](), ways["sharded"]()), "the two norms' bits differ"
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.reps + 5):  # alternately, so a drifting load hits both; the first 5 warm up
        for name, norm in ways.items():
            dist.barrier()
            start = time.perf_counter()
            norm()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        dtensor, sharded = (statistics.median(times[n][5:]) * 1e3 for n in ways)
        print(
            f"{args.layout:>12} {len(grads):>7} {dtensor:>10.3f} {sharded:>10.3f} {sharded / dtensor:>7.2f}"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    print(f"{'layout':>12} {'tensors':>7} {'dtensor ms':>10} {'sharded ms':>10} {'ratio':>7}")
    for layout, (world, mesh_shape) in LAYOUTS.items():
        args.layout = layout
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # a port it picks
        mp.spawn(rank_main, (world, mesh_shape, store.port, args), nprocs=world)


if __name__ == "__main__":
    main()
